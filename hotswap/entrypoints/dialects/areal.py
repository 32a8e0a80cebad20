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
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request

from hotswap.engine.errors import InvalidArgument
from hotswap.entrypoints.errors import APIError, bad_request
from hotswap.entrypoints.state import get_engine
from hotswap.entrypoints.verb_routes import (
    VerbRoute,
    call_route,
    call_verb,
    read_values,
    route_args,
    weight_round,
)
from hotswap.weight_transfer.base import parse_dtype_name

BROADCAST_BACKENDS = ("gloo", "nccl")
MAX_PORT = 65535


@dataclass
class ArealState:
    """Per server: the group AReaL initialised, and the meta set for the next update."""

    group_name: str | None = None
    meta: dict[str, list] | None = None


def _state(request: Request) -> ArealState:
    state = getattr(request.app.state, "areal", None)
    if state is None:
        state = request.app.state.areal = ArealState()
    return state


def _refused(error: InvalidArgument) -> APIError:
    return bad_request(str(error), f"body.{error.field}" if error.field else "body")


PAUSE = VerbRoute("/areal_pause_generation", "pause")
RESUME = VerbRoute("/areal_continue_generation", "resume")
INIT_FIELDS = ("master_address", "master_port", "rank_offset", "world_size", "backend",
               "group_name")  # fmt: skip
INIT = VerbRoute(
    "/areal_init_weights_update_group",
    "init_weight_transfer_engine",
    names={name: name for name in INIT_FIELDS},  # read as sent, checked here
)
META = VerbRoute(
    "/areal_set_update_weight_meta",
    "update_weights",
    names={name: name for name in ("names", "dtypes", "shapes", "group_name")},
)
# The update's chunk is the meta set before it: the engine's refusals of it name `meta`.
XCCL = VerbRoute("/areal_update_weights_xccl", "update_weights", names={"meta": "update_info"})
DISK = VerbRoute(
    "/areal_update_weights",
    "load_weights_from_disk",
    ignored=frozenset({"abort_all_requests"}),  # AReaL's route aborts them either way
    names={"load_format": "load_format"},
)

areal_router = APIRouter()


@areal_router.post("/areal_pause_generation")
async def areal_pause_generation(request: Request) -> dict[str, Any]:
    await read_values(request, PAUSE)
    await call_verb(request, PAUSE, "pause", mode="abort", clear_cache=True)
    return {"success": True, "message": "Generation paused and all requests aborted"}


@areal_router.post("/areal_continue_generation")
async def areal_continue_generation(request: Request) -> dict[str, Any]:
    await read_values(request, RESUME)
    await call_verb(request, RESUME, "resume")
    return {"success": True, "message": "Generation continued"}


@areal_router.post("/areal_init_weights_update_group")
async def areal_init_weights_update_group(request: Request) -> dict[str, Any]:
    values = await read_values(request, INIT)
    try:
        init_info, group_name = _init_info(request, values)
    except InvalidArgument as e:
        raise _refused(e) from None
    state = _state(request)
    state.group_name = state.meta = None  # the old group goes whatever happens
    try:
        await call_verb(request, INIT, "init_weight_transfer_engine", init_info=init_info)
    except APIError as e:  # the engine's `init_info.X` is the body's X
        param = (e.param or "").replace("body.init_info.", "body.", 1)
        raise APIError(e.status, e.message.replace("init_info.", "", 1), param) from None
    state.group_name = group_name
    return {"success": True, "message": "Weight update group initialized"}


def _init_info(request: Request, values: dict[str, Any]) -> tuple[dict[str, Any], str]:
    for name in INIT_FIELDS:
        if name not in values:
            raise InvalidArgument(name, f"{name}: required")
    address, group_name, backend = (
        values["master_address"], values["group_name"], values["backend"]
    )  # fmt: skip
    if not isinstance(address, str) or not address:
        raise InvalidArgument("master_address", "master_address: must be a host name or address")
    if not isinstance(group_name, str) or not group_name:
        raise InvalidArgument("group_name", "group_name: must be a non-empty string")
    port = values["master_port"]  # AReaL sends it as a string
    if isinstance(port, str) and port.isascii() and port.isdigit() and len(port) <= 5:
        port = int(port)
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= MAX_PORT:
        raise InvalidArgument("master_port", f"master_port: must be a port number, got "
                              f"{values['master_port']!r}")  # fmt: skip
    for name in ("rank_offset", "world_size"):
        value = values[name]
        if not isinstance(value, int) or isinstance(value, bool):
            raise InvalidArgument(name, f"{name}: must be an integer, got {value!r}")
    config = get_engine(request).config.weight_transfer
    if config is not None:
        if config.backend not in BROADCAST_BACKENDS:
            raise APIError(
                409,
                f"AReaL broadcasts weights over a process group, but this server receives "
                f"with the {config.backend!r} backend; start it with --weight-transfer-config "
                f'\'{{"backend": "nccl"}}\' (or "gloo" on CPU)',
            )
        if backend != config.backend:
            raise InvalidArgument("backend", f"backend: this server receives over "
                                  f"{config.backend!r}, got {backend!r}")  # fmt: skip
    init_info = {
        # AReaL writes an IPv6 address as a URL host: [::1]
        "master_address": address.removeprefix("[").removesuffix("]"),
        "master_port": port,
        "rank_offset": values["rank_offset"],
        "world_size": values["world_size"],
        "group_name": group_name,  # the trainer's torch-helper group: its keys, typed
        "packed": False,
    }
    return init_info, group_name


@areal_router.post("/areal_set_update_weight_meta")
async def areal_set_update_weight_meta(request: Request) -> dict[str, Any]:
    values = await read_values(request, META)
    state = _state(request)
    try:
        meta = update_info(values)
        group_name = values.get("group_name")
        if not isinstance(group_name, str):
            raise InvalidArgument("group_name", "group_name: required, a string")
    except InvalidArgument as e:
        raise _refused(e) from None
    if state.group_name is None:
        raise APIError(409, "areal_set_update_weight_meta: no weight update group; call "
                       "/areal_init_weights_update_group first")  # fmt: skip
    if group_name != state.group_name:
        raise bad_request(f"group_name: no weight update group named {group_name[:200]!r} "
                          f"(this server joined {state.group_name!r})",
                          "body.group_name")  # fmt: skip
    state.meta = meta
    return {"success": True, "message": "Success"}


def update_info(values: dict[str, Any]) -> dict[str, list]:
    """AReaL's names / dtypes / shapes as an update info, checked entry by entry."""
    lists = {}
    for key in ("names", "dtypes", "shapes"):
        value = values.get(key)
        if not isinstance(value, list):
            raise InvalidArgument(key, f"{key}: required, a list")
        lists[key] = value
    names, dtypes, shapes = lists["names"], lists["dtypes"], lists["shapes"]
    if not names:
        raise InvalidArgument("names", "names: must list at least one parameter")
    if not len(names) == len(dtypes) == len(shapes):
        raise InvalidArgument("names", f"names: names, dtypes and shapes differ in length "
                              f"({len(names)}, {len(dtypes)}, {len(shapes)})")  # fmt: skip
    for i, (name, dtype, shape) in enumerate(zip(names, dtypes, shapes)):
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"names[{i}]", f"names[{i}]: must be a non-empty string")
        try:
            parse_dtype_name(dtype, f"dtypes[{i}]")
        except ValueError as e:
            raise InvalidArgument(f"dtypes[{i}]", str(e)) from None
        if not isinstance(shape, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
        ):
            raise InvalidArgument(f"shapes[{i}]", f"shapes[{i}]: must be a list of sizes, "
                                  f"got {shape!r}")  # fmt: skip
    if len(set(names)) != len(names):
        duplicate = next(n for n in names if names.count(n) > 1)
        raise InvalidArgument("names", f"names: {duplicate!r} appears twice")
    return {"names": names, "dtype_names": dtypes, "shapes": shapes}


async def _paused_for(request: Request, route: VerbRoute, update: Callable[[], Awaitable]) -> None:
    """Run `update` with generation paused (abort, cache cleared), as AReaL's routes do;
    resume only if this call paused (a paused engine is AReaL's closed gate)."""
    running = not (await call_verb(request, route, "is_paused")).result
    if running:
        await call_verb(request, route, "pause", mode="abort", clear_cache=True)
    try:
        await update()
    except BaseException:
        if running:
            with contextlib.suppress(Exception):  # the update's own error is the answer
                await call_verb(request, route, "resume")
        raise
    if running:
        await call_verb(request, route, "resume")


@areal_router.post("/areal_update_weights_xccl")
async def areal_update_weights_xccl(request: Request) -> dict[str, Any]:
    await read_values(request, XCCL)
    state = _state(request)
    meta, state.meta = state.meta, None  # one update per meta, never a stale one
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
