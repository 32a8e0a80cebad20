"""PipelineRL's weight-update route (pipelinerl/vllm1.py), declared over the control verbs.
Registered only with the control plane enabled.

PipelineRL's trainer (pipelinerl/finetune_loop.py `WeightUpdateManager`) posts
`POST /receive_weight_update {"kind": "weight_update_request", "version": N,
"parameters_info": [{"name", "shape", "dtype": "torch.bfloat16"}, ...], "timestamp": T}`
to every actor server and, while that call is in flight, broadcasts each listed tensor in
order from rank 0 of its weight-update group, one broadcast per tensor. The server pauses
in keep mode without clearing the cache (in-flight requests stay frozen, their KV kept),
receives, loads, and always resumes. Here that is one route through the verbs: pause keep,
one weight round (start, the broadcast as one unpacked chunk, commit labelled with the
version), resume, even on failure.

PipelineRL's servers join the group at start-up from flags (`--weight-update-group-init-
method tcp://host:port --weight-update-group-world-size W --actor-llm-idx I`; a server's
first rank is 1 + I * its GPU count). hotswap takes the same four values on
`POST /init_actor_update_group` (the worker-extension call PipelineRL makes with them),
mapped onto `init_weight_transfer_engine`, plus an optional `group_name` (default "actor").

Which trainer group this meets: the one PipelineRL's trainer made with
`torch_utils.init_extra_process_group(group_name="actor", backend="nccl",
init_method=<the init method>, rank=0, world_size=W)` (pipelinerl/torch_utils.py, called
from finetune_loop.py up to commit 49f4c58, April 2026, its vLLM-0.8 line), broadcasting
with `dist.broadcast(tensor, src=0, group=...)`. That helper is a copy of torch's
`init_process_group`: a tcp:// rendezvous store (the trainer, rank 0, hosts it) prefixed
with the group name, then torch's `_new_process_group_helper`; the engine joins with the
same keys (hotswap/weight_transfer/broadcast.py `torch_group_store`), and the channel is
typed: one broadcast per tensor in its own dtype.

Not met: PipelineRL's current trainer (finetune_loop.py since d96c8b7,
`torch_utils.stateless_init_process_group`) makes its group with vLLM's
`StatelessProcessGroup` and `PyNcclCommunicator`, whose rank 0 hands the NCCL unique id to
the others as a pickled object through the store (`broadcast_obj`). hotswap never
unpickles what a peer sends, and has no PyNccl communicator, so such a trainer cannot be
joined: the trainer waits for its own keys, this server for torch's, until the timeout
(the init then fails). Use the torch-helper group above (`init_extra_process_group`, still
in pipelinerl/torch_utils.py) on the trainer side instead.
"""

from __future__ import annotations

import contextlib
from typing import Annotated, Any
from urllib.parse import urlsplit

import msgspec
from fastapi import APIRouter, Request

from hotswap.engine import verbs
from hotswap.engine.errors import InvalidArgument
from hotswap.entrypoints.server.errors import APIError, bad_request
from hotswap.entrypoints.server.group_join import GroupJoin
from hotswap.entrypoints.server.sessions import dialect_sessions
from hotswap.entrypoints.server.verb_routes import VerbRoute, call_verb, read_values, weight_round
from hotswap.weight_transfer.infos import (
    DTypeName,
    Info,
    Shape,
    TensorName,
    TensorsInfo,
    parse_info,
)

MAX_INT = 2**63 - 1
DEFAULT_GROUP = "actor"  # the name PipelineRL's init_extra_process_group calls gave

RECEIVE = VerbRoute(
    "/receive_weight_update",
    verbs.UpdateWeights,
    names={"parameters_info": "update_info", "version": "weight_version"},
    # update_info's lists are built from PipelineRL's one list of parameters.
    sources={f"update_info.{key}": "parameters_info" for key in TensorsInfo.LISTS},
    ignored=frozenset({"kind", "timestamp"}),
)
INIT = VerbRoute(
    "/init_actor_update_group",
    verbs.InitWeightTransfer,
    # PipelineRL's start-up flags, read as sent and checked here: the verb gets one init_info
    names={name: name for name in ("actor_idx", "actor_ngpus",
           "weight_update_group_init_method", "weight_update_group_world_size",
           "group_name")},
    # init_info's fields -> the body field each comes from (for refusals of them)
    sources={
        "init_info.master_address": "weight_update_group_init_method",
        "init_info.master_port": "weight_update_group_init_method",
        "init_info.world_size": "weight_update_group_world_size",
        "init_info.rank_offset": "actor_idx",
        "init_info.group_name": "group_name",
    },
)  # fmt: skip
JOIN = GroupJoin("PipelineRL", INIT, "pipelinerl")


class Parameter(msgspec.Struct, frozen=True):
    """One entry of PipelineRL's `parameters_info` (unknown keys ignored)."""

    name: TensorName
    shape: Shape
    dtype: DTypeName  # "torch.bfloat16": str(dtype)


class WeightUpdateRequest(Info):
    """PipelineRL's /receive_weight_update body: a refusal names its field
    (`parameters_info[3].dtype`)."""

    version: Annotated[int, msgspec.Meta(ge=0, le=MAX_INT, description="an integer >= 0")]
    parameters_info: Annotated[
        list[Parameter], msgspec.Meta(min_length=1, description="a non-empty list of parameters")
    ]

    def check(self) -> None:
        seen: set[str] = set()
        for i, parameter in enumerate(self.parameters_info):
            if parameter.name in seen:
                raise InvalidArgument(f"parameters_info[{i}].name", f"parameters_info[{i}].name: "
                                      f"{parameter.name!r} appears twice")  # fmt: skip
            seen.add(parameter.name)

    def update_info(self) -> dict[str, list]:
        """The tensors listed, as an update info (names, dtype_names, shapes)."""
        return {
            "names": [p.name for p in self.parameters_info],
            "dtype_names": [p.dtype for p in self.parameters_info],
            "shapes": [p.shape for p in self.parameters_info],
        }


def _integer(values: dict[str, Any], name: str, low: int = 0) -> int:
    value = values.get(name)
    if value is None:
        raise InvalidArgument(name, f"{name}: required")
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= MAX_INT:
        raise InvalidArgument(name, f"{name}: must be an integer >= {low}, got {value!r}")
    return value


def _refused(error: InvalidArgument) -> APIError:
    return bad_request(str(error), f"body.{error.field}" if error.field else "body")


pipelinerl_router = APIRouter()


@pipelinerl_router.post("/receive_weight_update")
async def receive_weight_update(request: Request) -> dict[str, str]:
    values = await read_values(request, RECEIVE)
    try:
        update = parse_info(WeightUpdateRequest, values, "")
    except InvalidArgument as e:
        raise _refused(e) from None
    JOIN.check(request)
    # One update at a time (as PipelineRL's own server): a second must not resume
    # generation in the middle of the first.
    async with dialect_sessions(request).pipelinerl.lock:
        await call_verb(request, RECEIVE, verbs.Pause, mode="keep", clear_cache=False)
        try:
            await weight_round(request, RECEIVE, [update.update_info()],
                               weight_version=str(update.version))  # fmt: skip
        except BaseException:
            with contextlib.suppress(Exception):  # the round's own error is the answer
                await call_verb(request, RECEIVE, verbs.Resume)
            raise
        await call_verb(request, RECEIVE, verbs.Resume)
    return {"status": "ok"}


@pipelinerl_router.post("/init_actor_update_group")
async def init_actor_update_group(request: Request) -> dict[str, str]:
    """Join PipelineRL's weight-update group (torch's helpers, named `group_name`): the
    trainer is rank 0, this server's first worker is rank 1 + actor_idx * actor_ngpus;
    tensors come one broadcast each, in their own dtype."""
    values = await read_values(request, INIT)
    try:
        actor_idx = _integer(values, "actor_idx")
        actor_ngpus = _integer(values, "actor_ngpus", low=1)
        world_size = _integer(values, "weight_update_group_world_size", low=2)
        address, port = _tcp_address(values.get("weight_update_group_init_method"))
    except InvalidArgument as e:
        raise _refused(e) from None
    rank_offset = 1 + actor_idx * actor_ngpus
    if rank_offset + actor_ngpus > world_size:
        raise bad_request(
            f"actor_idx: this server's ranks [{rank_offset}, {rank_offset + actor_ngpus}) lie "
            f"outside weight_update_group_world_size {world_size}",
            "body.actor_idx",
        )
    init_info = {"master_address": address, "master_port": port, "world_size": world_size,
                 "rank_offset": rank_offset,
                 "group_name": values.get("group_name", DEFAULT_GROUP)}  # fmt: skip
    await JOIN.join(request, init_info)
    return {"status": "ok"}


def _tcp_address(method: object) -> tuple[str, int]:
    field = "weight_update_group_init_method"
    if not isinstance(method, str):
        raise InvalidArgument(field, f"{field}: required, tcp://host:port")
    try:
        parts = urlsplit(method)
        scheme, host, port = parts.scheme, parts.hostname, parts.port
    except ValueError:  # a port out of range
        scheme = host = port = None
    if scheme != "tcp" or not host or not port:
        raise InvalidArgument(field, f"{field}: must be tcp://host:port, got {method[:200]!r}")
    return host, port
