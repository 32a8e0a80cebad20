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

import asyncio
import contextlib
from typing import Any
from urllib.parse import urlsplit

from fastapi import APIRouter, Request

from hotswap.engine.errors import InvalidArgument
from hotswap.entrypoints.errors import APIError, bad_request
from hotswap.entrypoints.state import get_engine
from hotswap.entrypoints.verb_routes import VerbRoute, call_verb, read_values, weight_round
from hotswap.weight_transfer.base import parse_dtype_name

BROADCAST_BACKENDS = ("gloo", "nccl")
MAX_INT = 2**63 - 1
DEFAULT_GROUP = "actor"  # the name PipelineRL's init_extra_process_group calls gave

RECEIVE = VerbRoute(
    "/receive_weight_update",
    "update_weights",
    names={"parameters_info": "update_info", "version": "weight_version"},
    ignored=frozenset({"kind", "timestamp"}),
)
INIT = VerbRoute(
    "/init_actor_update_group",
    "init_weight_transfer_engine",
    # PipelineRL's start-up flags, read as sent and checked here: the verb gets one init_info
    names={name: name for name in ("actor_idx", "actor_ngpus",
           "weight_update_group_init_method", "weight_update_group_world_size",
           "group_name")},
)  # fmt: skip
# init_info's fields -> the body field each comes from (for the engine's refusals)
INIT_SOURCES = {
    "master_address": "weight_update_group_init_method",
    "master_port": "weight_update_group_init_method",
    "world_size": "weight_update_group_world_size",
    "rank_offset": "actor_idx",
    "group_name": "group_name",
}


def _integer(values: dict[str, Any], name: str, low: int = 0) -> int:
    value = values.get(name)
    if value is None:
        raise InvalidArgument(name, f"{name}: required")
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= MAX_INT:
        raise InvalidArgument(name, f"{name}: must be an integer >= {low}, got {value!r}")
    return value


def update_info(parameters_info: object) -> dict[str, list]:
    """`parameters_info` as an update info (names, dtype_names, shapes), each entry checked;
    a refusal names the entry's field (`parameters_info[3].dtype`)."""
    field = "parameters_info"
    if not isinstance(parameters_info, list) or not parameters_info:
        raise InvalidArgument(field, f"{field}: must be a non-empty list of parameters")
    names: list[str] = []
    info: dict[str, list] = {"names": names, "dtype_names": [], "shapes": []}
    for i, entry in enumerate(parameters_info):
        where = f"{field}[{i}]"
        if not isinstance(entry, dict):
            raise InvalidArgument(where, f"{where}: must be an object with name, shape, dtype")
        name, shape, dtype = entry.get("name"), entry.get("shape"), entry.get("dtype")
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"{where}.name", f"{where}.name: must be a non-empty string")
        if name in names:
            raise InvalidArgument(f"{where}.name", f"{where}.name: {name!r} appears twice")
        if not isinstance(shape, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
        ):
            raise InvalidArgument(f"{where}.shape", f"{where}.shape: must be a list of sizes, "
                                  f"got {shape!r}")  # fmt: skip
        try:
            parse_dtype_name(dtype, f"{where}.dtype")
        except ValueError as e:
            raise InvalidArgument(f"{where}.dtype", str(e)) from None
        names.append(name)
        info["dtype_names"].append(dtype)
        info["shapes"].append(shape)
    return info


def _refused(error: InvalidArgument) -> APIError:
    return bad_request(str(error), f"body.{error.field}" if error.field else "body")


def require_broadcast_backend(request: Request, framework: str) -> None:
    """A 409 unless the server receives over a process group (gloo or nccl): any other
    backend would read the trainer's calls as something else. Unconfigured: the engine's
    own refusal says how to configure it."""
    config = get_engine(request).config.weight_transfer
    if config is not None and config.backend not in BROADCAST_BACKENDS:
        raise APIError(
            409,
            f"{framework} broadcasts weights over a process group, but this server receives "
            f"with the {config.backend!r} backend; start it with --weight-transfer-config "
            f'\'{{"backend": "nccl"}}\' (or "gloo" on CPU)',
        )


def _lock(request: Request) -> asyncio.Lock:
    """One weight update at a time (as PipelineRL's own server): a second must not resume
    generation in the middle of the first."""
    state = request.app.state
    lock = getattr(state, "pipelinerl_update_lock", None)
    if lock is None:
        lock = state.pipelinerl_update_lock = asyncio.Lock()
    return lock


pipelinerl_router = APIRouter()


@pipelinerl_router.post("/receive_weight_update")
async def receive_weight_update(request: Request) -> dict[str, str]:
    values = await read_values(request, RECEIVE)
    try:
        version = _integer(values, "version")
        chunk = update_info(values.get("parameters_info"))
    except InvalidArgument as e:
        raise _refused(e) from None
    require_broadcast_backend(request, "PipelineRL")
    async with _lock(request):
        await call_verb(request, RECEIVE, "pause", mode="keep", clear_cache=False)
        try:
            await weight_round(request, RECEIVE, [chunk], weight_version=str(version))
        except BaseException:
            with contextlib.suppress(Exception):  # the round's own error is the answer
                await call_verb(request, RECEIVE, "resume")
            raise
        await call_verb(request, RECEIVE, "resume")
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
        group_name = values.get("group_name", DEFAULT_GROUP)
        if not isinstance(group_name, str) or not group_name:
            raise InvalidArgument("group_name", "group_name: must be a non-empty string")
    except InvalidArgument as e:
        raise _refused(e) from None
    rank_offset = 1 + actor_idx * actor_ngpus
    if rank_offset + actor_ngpus > world_size:
        raise bad_request(
            f"actor_idx: this server's ranks [{rank_offset}, {rank_offset + actor_ngpus}) lie "
            f"outside weight_update_group_world_size {world_size}",
            "body.actor_idx",
        )
    require_broadcast_backend(request, "PipelineRL")
    init_info = {"master_address": address, "master_port": port, "world_size": world_size,
                 "rank_offset": rank_offset, "group_name": group_name,
                 "packed": False}  # fmt: skip
    try:
        await call_verb(request, INIT, "init_weight_transfer_engine", init_info=init_info)
    except APIError as e:
        raise _init_refusal(e) from None
    return {"status": "ok"}


def _init_refusal(error: APIError) -> APIError:
    """An engine refusal of `init_info.X` (an address not allowed, no store answering)
    names the body field X came from."""
    head, _, rest = (error.param or "").partition("body.init_info.")
    wire = INIT_SOURCES.get(rest.split(".")[0]) if not head and rest else None
    if wire is None:
        return error
    return APIError(error.status, f"{wire}: {error.message}", f"body.{wire}")


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
