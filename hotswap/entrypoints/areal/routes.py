"""AReaL's vLLM-server routes (areal/engine/vllm_ext/areal_vllm_server.py), declared over
the control verbs. Registered only with the control plane enabled.

What AReaL's trainer sends (areal/engine/vllm_remote.py `VLLMBackend`, driven by
areal/engine/fsdp_engine.py), every body as below:

- `/areal_pause_generation {}` and `/areal_continue_generation {}` around each update:
  pause aborting everything in flight and clearing the cache; resume.
- `/areal_init_weights_update_group {"master_address", "master_port": "<str>",
  "rank_offset", "world_size", "backend", "group_name"}` once: this server joins the
  trainer's group (the trainer is rank 0) -> `init_weight_transfer_engine` with the
  `group_name`. The trainer makes rank 0 of that group with `init_custom_process_group`
  (areal/engine/core/distributed.py, called from fsdp_engine.py
  `_init_weight_update_from_distributed` with init_method tcp://master_address:master_port,
  group_name "update_weight_group", or "update_weight_group_{pp_rank}" per PP stage): a
  tcp:// rendezvous store (rank 0 hosts it) prefixed with the group name, then torch's
  `_new_process_group_helper`; the engine joins with the same keys
  (hotswap/weight_transfer/broadcast.py `torch_group_store`). The channel is then unpacked
  and typed: one `dist.broadcast` per tensor, in its own dtype.
- Per bucket of parameters: `/areal_set_update_weight_meta {"names", "dtypes": ["bfloat16",
  ...], "shapes", "group_name"}`, then `/areal_update_weights_xccl {}` while the trainer
  broadcasts each listed tensor in order. The meta is kept here (per server) until the
  update that consumes it; that update is one whole weight round (start, the broadcast as
  one chunk, commit): a failed bucket leaves the weights as they were before it.
- `/areal_update_weights {"model_path"}`: reload from the HF checkpoint the trainer saved
  -> `load_weights_from_disk`.

AReaL's own update routes pause and resume the engine around themselves while its HTTP
gate keeps completions waiting until `/areal_continue_generation`; here a paused engine is
that gate, so an update pauses (abort, clear the cache) and resumes only when it found the
engine running. AReaL's versions travel outside these calls: a commit keeps the label.
LoRA updates are refused (501).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request

from hotswap.engine import verbs
from hotswap.entrypoints.server.errors import APIError, bad_request
from hotswap.entrypoints.server.group_join import GroupJoin
from hotswap.entrypoints.server.sessions import dialect_sessions
from hotswap.entrypoints.server.verb_routes import (
    VerbRoute,
    call_route,
    call_verb,
    decimal_int,
    read_values,
    route_args,
    route_info,
    weight_round,
)
from hotswap.weight_transfer.infos import TensorsInfo

PAUSE = VerbRoute("/areal_pause_generation", verbs.Pause)
RESUME = VerbRoute("/areal_continue_generation", verbs.Resume)
INIT_FIELDS = ("master_address", "master_port", "rank_offset", "world_size", "backend",
               "group_name")  # fmt: skip


# AReaL's init fields are init_info's own keys (a refusal of init_info.master_port names
# body.master_port); `backend`, its group's, is checked against the engine's.
INIT = VerbRoute(
    "/areal_init_weights_update_group",
    verbs.InitWeightTransfer,
    names={name: f"init_info.{name}" for name in INIT_FIELDS if name != "backend"},
    consumes=frozenset({"backend"}),
)
JOIN = GroupJoin("AReaL", INIT, "areal", backend_field="backend")
# The meta is the next update's info under AReaL's names; lists of other lengths (the info
# as a whole) are refused as `names`'.
META = VerbRoute(
    "/areal_set_update_weight_meta",
    verbs.UpdateWeights,
    names={"names": "update_info.names", "dtypes": "update_info.dtype_names",
           "shapes": "update_info.shapes"},
    consumes=frozenset({"group_name"}),
    sources={"update_info": "names"},
)  # fmt: skip
# The update's chunk is the meta set before it: the engine's refusals of it name `meta`.
# The update's lists come from the meta set before: a tensor the model cannot take is
# refused as that meta's.
XCCL = VerbRoute(
    "/areal_update_weights_xccl",
    verbs.UpdateWeights,
    names={"meta": "update_info"},
    sources={f"update_info.{key}": "meta" for key in TensorsInfo.LISTS},
)
DISK = VerbRoute(
    "/areal_update_weights",
    verbs.LoadWeightsFromDisk,
    ignored=frozenset({"abort_all_requests"}),  # AReaL's route aborts them either way
    names={"load_format": "load_format"},
)

areal_router = APIRouter()


@areal_router.post("/areal_pause_generation")
async def areal_pause_generation(request: Request) -> dict[str, Any]:
    await read_values(request, PAUSE)
    await call_verb(request, PAUSE, verbs.Pause, mode="abort", clear_cache=True)
    return {"success": True, "message": "Generation paused and all requests aborted"}


@areal_router.post("/areal_continue_generation")
async def areal_continue_generation(request: Request) -> dict[str, Any]:
    await read_values(request, RESUME)
    await call_verb(request, RESUME, verbs.Resume)
    return {"success": True, "message": "Generation continued"}


@areal_router.post("/areal_init_weights_update_group")
async def areal_init_weights_update_group(request: Request) -> dict[str, Any]:
    values = await read_values(request, INIT)
    for name in INIT_FIELDS:  # AReaL always sends them all
        if name not in values:
            raise bad_request(f"{name}: required", f"body.{name}")
    await JOIN.join(request, _init_info(values), values)  # the old group's meta goes too
    return {"success": True, "message": "Weight update group initialized"}


def _init_info(values: dict[str, Any]) -> dict[str, Any]:
    """AReaL's spellings as init_info's: master_port as a string, an IPv6 address as a URL
    host ([::1])."""
    info = {name: values[name] for name in INIT.names}
    address = info["master_address"]
    if isinstance(address, str):
        info["master_address"] = address.removeprefix("[").removesuffix("]")
    info["master_port"] = decimal_int(info["master_port"])
    return info


@areal_router.post("/areal_set_update_weight_meta")
async def areal_set_update_weight_meta(request: Request) -> dict[str, Any]:
    values = await read_values(request, META)
    session = dialect_sessions(request).areal
    group_name = values.pop("group_name", None)
    meta = route_info(META, TensorsInfo, values)
    if not meta["names"]:
        raise bad_request("names: must list at least one parameter", "body.names")
    if not isinstance(group_name, str):
        raise bad_request("group_name: required, a string", "body.group_name")
    if not session.is_joined:
        raise APIError(409, "areal_set_update_weight_meta: no weight update group; call "
                       "/areal_init_weights_update_group first")  # fmt: skip
    if group_name != session.group_name:
        raise bad_request(f"group_name: no weight update group named {group_name[:200]!r} "
                          f"(this server joined {session.group_name!r})",
                          "body.group_name")  # fmt: skip
    session.meta = meta
    return {"success": True, "message": "Success"}


async def _paused_for(request: Request, route: VerbRoute, update: Callable[[], Awaitable]) -> None:
    """Run `update` with generation paused (abort, cache cleared), as AReaL's routes do;
    resume only if this call paused (a paused engine is AReaL's closed gate)."""
    running = not (await call_verb(request, route, verbs.IsPaused)).result
    if running:
        await call_verb(request, route, verbs.Pause, mode="abort", clear_cache=True)
    try:
        await update()
    except BaseException:
        if running:
            with contextlib.suppress(Exception):  # the update's own error is the answer
                await call_verb(request, route, verbs.Resume)
        raise
    if running:
        await call_verb(request, route, verbs.Resume)


@areal_router.post("/areal_update_weights_xccl")
async def areal_update_weights_xccl(request: Request) -> dict[str, Any]:
    await read_values(request, XCCL)
    session = dialect_sessions(request).areal
    meta, session.meta = session.meta, None  # one update per meta, never a stale one
    if meta is None:
        raise APIError(409, "areal_update_weights_xccl: no weight meta; call "
                       "/areal_set_update_weight_meta first")  # fmt: skip
    await _paused_for(request, XCCL, lambda: weight_round(request, XCCL, [meta]))
    return {"success": True, "message": "Success"}


@areal_router.post("/areal_update_weights")
async def areal_update_weights(request: Request) -> dict[str, Any]:
    values = await read_values(request, DISK)
    load_format = values.pop("load_format", None)
    if load_format not in (None, "auto", "safetensors"):
        raise bad_request("load_format: only safetensors checkpoints (auto)", "body.load_format")
    args = route_args(DISK, values)
    await _paused_for(request, DISK, lambda: call_route(request, DISK, args))
    return {"success": True, "message": "Success"}


async def _lora(request: Request) -> None:
    raise APIError(501, f"{request.url.path}: LoRA adapters are not supported")


for _path in (
    "/areal_update_weights_lora",
    "/areal_set_update_weight_meta_lora",
    "/areal_update_weights_lora_xccl",
):
    areal_router.add_api_route(_path, _lora, methods=["POST"])
