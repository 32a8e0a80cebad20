"""SGLang's weight-sync routes (a trainer's broadcast group), request aborts and load
report, composed from the control verbs. Registered only with the control plane enabled;
the routes of sglang.py (pause/continue, flush_cache, disk reloads) come first in an RL
step, these after.

What the RL frameworks send (as built in their sources):
- slime (slime/backends/sglang_utils/sglang_engine.py; the trainer side in
  slime/backends/megatron_utils/update_weight/update_weight_from_distributed.py):
  POST /init_weights_update_group {master_address, master_port (int), rank_offset,
  world_size, group_name ("slime-pp_{pp_rank}"), backend ("nccl" on GPUs)} while the trainer
  makes rank 0 of that group with a copy of torch's `init_process_group` (a tcp:// rendezvous
  store prefixed with the group name, then `_new_process_group_helper`); then per bucket
  POST /update_weights_from_distributed {names, dtypes ("bfloat16": str(dtype) without
  "torch."), shapes, group_name, flush_cache: false, weight_version: str(step)} while it
  posts `dist.broadcast(tensor, 0, group=..., async_op=True)` for every tensor of the bucket in
  `names` order and waits for them all. Several buckets share one weight_version; around
  the whole update it calls /pause_generation, GET /flush_cache and /continue_generation.
  On reconnect it calls /destroy_weights_update_group {group_name} and ignores a failure.
- AReaL (areal/engine/sglang_remote.py): the same init payload but master_port as a
  string, asserting `success` in the answer; updates {names, dtypes, shapes, group_name,
  abort_all_requests: true} (flush_cache left at SGLang's default, true).
- /update_weights_from_tensor (slime's colocated path, verl's HTTP adapter) sends
  `serialized_named_tensors`: base64 pickles (MultiprocessingSerializer) of tensors or of
  CUDA IPC handles. hotswap never unpickles request bytes: that form is refused (400) with
  what to use instead. The route takes a JSON-safe form in its place (hotswap's; SGLang
  defines none), the tensors by value: {"named_tensors": [{"name", "dtype" ("bfloat16": a
  dtype name without "torch."), "shape", "data" (base64 of the raw little-endian bytes, C
  order)}], "weight_version", "flush_cache" (default true), "abort_all_requests",
  "load_format": null}. Per tensor these are the fields LMDeploy's structured
  /update_weights payload uses ({dtype, shape, data}, in a dict keyed by name there); a
  list keeps the order and lets a refusal name its entry (body.named_tensors[3].data). It
  is the `load_weights_inline` verb: one validated, all-or-nothing round, as a disk reload,
  changing only the tensors named (unless the weight transfer config requires complete
  rounds). Its size is bounded by the request body limit (--max-request-body-bytes, 32 MiB
  by default: about 24 MiB of tensor bytes once base64-encoded): for whole models use a
  broadcast group, the disk or a weight transfer backend.

SGLang's own answers (python/sglang/srt/entrypoints/http_server.py) are
{"success": true, "message": ...}; a refusal here is hotswap's error envelope (400 naming
the field in SGLang's spelling: body.dtypes[0], body.master_port, ...; 409 for a state
the call cannot run in). An update is one whole round (start, receive, commit with
`weight_version`), aborted on any failure: the weights and version stay as they were.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from hotswap.engine import verbs
from hotswap.engine.errors import EngineStateError, InvalidArgument
from hotswap.entrypoints.server.errors import APIError, bad_request
from hotswap.entrypoints.server.group_join import GroupJoin
from hotswap.entrypoints.server.sessions import dialect_sessions
from hotswap.entrypoints.server.state import get_engine
from hotswap.entrypoints.server.verb_routes import (
    Done,
    VerbRoute,
    call_route,
    call_verb,
    decimal_int,
    read_body_fields,
    route_args,
    weight_round,
)
from hotswap.weight_transfer.infos import TensorsInfo, parse_info

sglang_weights_router = APIRouter()

DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name

# SGLang's fields are init_info's own keys, and update_info's lists under its names: a
# refusal of init_info.master_port names body.master_port, of update_info.dtype_names[0]
# body.dtypes[0].
INIT = VerbRoute(
    "/init_weights_update_group",
    verbs.InitWeightTransfer,
    names={key: f"init_info.{key}" for key in ("master_address", "master_port", "rank_offset",
                                               "world_size", "group_name")},
)  # fmt: skip
# The group's torch backend is checked against the engine's; SGLang's default is nccl.
JOIN = GroupJoin("SGLang", INIT, "sglang", backend_field="backend", default_backend="nccl")
UPDATE_NAMES = {"names": "update_info.names", "dtypes": "update_info.dtype_names",
                "shapes": "update_info.shapes"}  # fmt: skip
UPDATE = VerbRoute("/update_weights_from_distributed", verbs.UpdateWeights, names=UPDATE_NAMES)
TENSOR = VerbRoute(
    "/update_weights_from_tensor", verbs.LoadWeightsInline, names={"named_tensors": "tensors"}
)

INIT_FIELDS = frozenset(
    {"master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"}
)
UPDATE_FIELDS = frozenset({"names", "dtypes", "shapes", "group_name", "flush_cache",
                           "abort_all_requests", "weight_version", "load_format",
                           "torch_empty_cache"})  # fmt: skip
TENSOR_FIELDS = frozenset({"serialized_named_tensors", "named_tensors", "load_format",
                           "flush_cache", "abort_all_requests", "weight_version",
                           "disable_draft_model", "torch_empty_cache"})  # fmt: skip
DESTROY_FIELDS = frozenset({"group_name"})


# -- /init_weights_update_group ----------------------------------------------------------
@sglang_weights_router.post("/init_weights_update_group")
async def init_weights_update_group(request: Request) -> dict[str, Any]:
    """Join the trainer's group as ranks rank_offset.. (one per engine core); blocks until
    the trainer joins too (or the transfer's timeout)."""
    values = await read_body_fields(request, INIT_FIELDS)
    init_info: dict[str, Any] = {"group_name": _group_name(values)}
    address = values.get("master_address")
    if address is not None:
        init_info["master_address"] = address
    for key in ("master_port", "rank_offset", "world_size"):
        if key in values:
            init_info[key] = decimal_int(values[key])
    await JOIN.join(request, init_info, values)
    return {"success": True, "message": "Succeeded to initialize custom process group."}


# -- /update_weights_from_distributed ----------------------------------------------------
@sglang_weights_router.post("/update_weights_from_distributed")
async def update_weights_from_distributed(request: Request) -> dict[str, Any]:
    """One whole round over the joined group: the tensors named, one broadcast each in
    `names` order, staged, then committed at once as version + 1 labelled weight_version
    (the current label if none). flush_cache (SGLang's default true) empties the prefix
    cache after the commit; abort_all_requests aborts every request first."""
    values = await read_body_fields(request, UPDATE_FIELDS)
    group_name = _group_name(values)
    session = dialect_sessions(request).sglang
    joined = session.group_name
    if not session.is_joined:  # also keeps another dialect's channel from receiving SGLang's stream
        raise APIError(
            409,
            "update_weights_from_distributed: no weight-update group: create one with "
            "/init_weights_update_group first",
        )
    if group_name != joined:
        raise bad_request(
            f"group_name: this server is in the weight-update group {joined!r}, not {group_name!r}",
            "body.group_name",
        )
    if values.get("load_format") not in (None, "auto"):
        raise bad_request(
            f"load_format: only plain named tensors (null) can be received, got "
            f"{values['load_format']!r}",
            "body.load_format",
        )
    flush_cache = flag(values, "flush_cache", True)
    abort_all = flag(values, "abort_all_requests", False)
    update_info = _update_info(values)
    engine = get_engine(request)
    if abort_all:
        await engine.abort()
    try:
        done = await weight_round(request, UPDATE, [update_info], values.get("weight_version"))
    except APIError as e:
        error, left = _respell_update(e, values)
        if left:
            session.fail()
            error.message += (
                " (the update could not be sized, so the trainer's broadcasts for it cannot "
                "be received: the group was left; create it again with "
                "/init_weights_update_group)"
            )
        raise error from None
    except EngineStateError as e:
        message = str(e)
        if "init_weight_transfer_engine" in message:
            message += " (SGLang's route: /init_weights_update_group)"
        raise APIError(409, message) from None
    return await _updated(request, UPDATE, done, flush_cache, values)


def flag(values: dict[str, Any], key: str, default: bool) -> bool:
    """A boolean field of a body read by hand (null: the default)."""
    value = values.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{key}: must be a boolean, got {value!r}", f"body.{key}")
    return value


def _respell_update(error: APIError, values: dict[str, Any]) -> tuple[APIError, bool]:
    """A refusal of the round (already in SGLang's names where UPDATE declares them), and
    whether the engine left the group: it does when it cannot size the chunk (its lists
    malformed or of other lengths: the sender is then out of step with it); a chunk the
    model cannot take (names, shapes) is drained instead and the group stays usable."""
    if error.status != 400 or not error.param:
        return error, False
    left = not _sizable(values)
    short = _short_list(values)
    if error.param == "body.update_info" and short is not None:  # name the list at fault
        message = error.message.removeprefix("update_info: ").replace("dtype_names", "dtypes")
        return APIError(error.status, message, short), left
    return error, left


def _sizable(values: dict[str, Any]) -> bool:
    """Whether the chunk's lists describe tensors the engine can size: they parse as the
    broadcast backends' update info, as the engine parses them."""
    try:
        parse_info(TensorsInfo, _update_info(values), "update_info")
    except InvalidArgument:
        return False
    return True


def _update_info(values: dict[str, Any]) -> dict[str, Any]:
    """The engine's update_info from SGLang's fields (UPDATE's names)."""
    return {path.removeprefix("update_info."): values[theirs]
            for theirs, path in UPDATE_NAMES.items() if theirs in values}  # fmt: skip


def _short_list(values: dict[str, Any]) -> str | None:
    """The list (SGLang's name) whose length differs from `names`, read from the request."""
    names = values.get("names")
    if not isinstance(names, list):
        return None
    for key in ("dtypes", "shapes"):
        other = values.get(key)
        if isinstance(other, list) and len(other) != len(names):
            return f"body.{key}"
    return None


# -- /update_weights_from_tensor, /destroy_weights_update_group -------------------------
@sglang_weights_router.post("/update_weights_from_tensor")
async def update_weights_from_tensor(request: Request) -> dict[str, Any]:
    """The tensors sent by value in `named_tensors` (see the module's docstring), loaded
    in one round and committed as version + 1 labelled weight_version (the current label
    if none); only they change. flush_cache (default true) empties the prefix cache after
    the commit; abort_all_requests aborts every request first. SGLang's pickled
    `serialized_named_tensors` is refused unread: hotswap never unpickles request bytes."""
    values = await read_body_fields(request, TENSOR_FIELDS)
    if values.get("serialized_named_tensors") is not None:
        raise bad_request(
            "serialized_named_tensors: refused: SGLang's tensors are pickles "
            "(MultiprocessingSerializer, often of CUDA IPC handles) and hotswap never "
            "unpickles request bytes. Send the tensors by value instead (named_tensors: "
            "[{name, dtype, shape, data: base64 of the raw little-endian bytes}]), or send "
            "weights over a broadcast group (/init_weights_update_group, "
            "/update_weights_from_distributed), from a safetensors directory "
            "(/update_weights_from_disk), or with hotswap's ipc backend "
            "(/init_weight_transfer_engine, /update_weights)",
            "body.serialized_named_tensors",
        )
    if values.get("named_tensors") is None:
        raise bad_request(
            "named_tensors: required: a list of {name, dtype, shape, data} (data: base64 of "
            "the tensor's raw little-endian bytes, C order)",
            "body.named_tensors",
        )
    load_format = values.get("load_format")
    if load_format not in (None, "auto"):
        raise bad_request(
            f"load_format: named_tensors are plain tensors (null), got {repr(load_format)[:100]}",
            "body.load_format",
        )
    flush_cache = flag(values, "flush_cache", True)
    abort_all = flag(values, "abort_all_requests", False)
    # Validated (base64 decoded, dtypes, shapes) before anything is aborted or sent.
    args = route_args(TENSOR, {k: values[k] for k in ("named_tensors", "weight_version")
                               if k in values})  # fmt: skip
    if abort_all:
        await get_engine(request).abort()
    done = await call_route(request, TENSOR, args)
    return await _updated(request, TENSOR, done, flush_cache, values)


async def _updated(
    request: Request, route: VerbRoute, done: Done, flush_cache: bool, values: dict[str, Any]
) -> dict[str, Any]:
    """SGLang's answer to a committed update, after the prefix-cache flush it asked for."""
    if flush_cache:
        await call_verb(request, route, verbs.ResetPrefixCache)
    label = done.result["label"]
    message = "Succeeded to update parameter online."
    if values.get("weight_version") is not None:
        message += f" Weight version updated to {label}."
    return {
        "success": True,
        "message": message,
        "weight_version": label,
        "version": done.result["version"],
    }


@sglang_weights_router.post("/destroy_weights_update_group")
async def destroy_weights_update_group(request: Request) -> dict[str, Any]:
    """Leave the group named (refused mid-round: 409); a later init joins a new one."""
    values = await read_body_fields(request, DESTROY_FIELDS)
    group_name = _group_name(values)
    session = dialect_sessions(request).sglang
    joined = session.group_name
    if session.is_joined and group_name != joined:
        raise bad_request(
            f"group_name: this server is in the weight-update group {joined!r}, not {group_name!r}",
            "body.group_name",
        )
    left = await get_engine(request).leave_weight_transfer()
    session.close()
    message = f"left {group_name!r}" if left else "no weight-update group to leave"
    return {"success": True, "message": message}


# -- shared ------------------------------------------------------------------------------
def _group_name(values: dict[str, Any]) -> str:
    name = values.get("group_name", DEFAULT_GROUP)
    if not isinstance(name, str) or not 0 < len(name) <= 256:
        raise bad_request("group_name: must be a string of 1 to 256 characters",
                          "body.group_name")  # fmt: skip
    return name
