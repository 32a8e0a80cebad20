"""vLLM's RL control routes (its dev-mode server: pause, sleep, weight transfer, versions),
declared over the control verbs. Registered only with the control plane enabled."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from hotswap.engine import verbs
from hotswap.engine.errors import InvalidArgument
from hotswap.entrypoints.prime_rl.routes import update_weights_from_dir
from hotswap.entrypoints.server.errors import bad_request
from hotswap.entrypoints.server.sessions import dialect_sessions
from hotswap.entrypoints.server.state import get_engine
from hotswap.entrypoints.server.verb_routes import (
    Done,
    VerbRoute,
    add_verb_routes,
    call_route,
    info_backend,
    json_object,
    route_args,
)


def weight_info_answer(info: dict[str, Any]) -> dict[str, Any]:
    """/weight_info's shape: the label as `weight_version` (vLLM's name), the integer
    version and the digest; ranks that disagree are listed (digest is then null)."""
    out = {"weight_version": info["label"], "version": info["version"], "digest": info["digest"]}
    if "rank_digests" in info:
        out["rank_digests"] = info["rank_digests"]
    return {**out, **version_names(info)}


def version_names(info: dict[str, Any]) -> dict[str, Any]:
    """The same version under the names of vLLM's RL RFC: `weight_gen` (the integer, +1
    per commit) and `weight_label`."""
    return {"weight_gen": info["version"], "weight_label": info["label"]}


def _finished(done: Done) -> dict[str, Any]:
    if done.args.abort:
        return {"message": "Weight update aborted"}
    # What this call committed (a later /weight_info may already name another commit).
    answer = {"message": "Weight update finished", **weight_info_answer(done.result)}
    if done.args.checksum:
        answer["checksums"] = done.result.get("checksums")
    if done.result.get("lora_name") is not None:  # a round into a LoRA adapter: its version
        answer.update(lora_name=done.result["lora_name"], lora_version=done.result["lora_version"])
    return answer


def _pause_args(values: dict[str, Any]) -> dict[str, Any]:
    """vLLM's deprecated `wait_for_inflight_requests=true` means mode `wait`."""
    wait = values.pop("wait_for_inflight_requests", "false")
    if str(wait).lower() in ("true", "1"):
        if values.get("mode", "wait") != "wait":
            raise InvalidArgument("wait_for_inflight_requests", "wait_for_inflight_requests: "
                                  "contradicts mode; send mode=wait")  # fmt: skip
        values["mode"] = "wait"
    return values


def _finish_args(values: dict[str, Any]) -> dict[str, Any]:
    """vLLM's RFC names the label `weight_label`; it is the same thing as `weight_version`."""
    label = values.pop("weight_label", None)
    if label is not None and values.get("weight_version", label) != label:
        raise InvalidArgument("weight_label", "weight_label: differs from weight_version; "
                              "send one of them")  # fmt: skip
    if label is not None:
        values["weight_version"] = label
    return values


def _woken(done: Done) -> dict[str, Any]:
    return {
        "status": "sleeping" if done.result["is_sleeping"] else "awake",
        # vLLM's answer: the tags asked for (hotswap may also wake `scheduling` with them)
        "tags_woken": list(done.args.tags) if done.args.tags else None,
        "elapsed_ms": 1000 * done.seconds,
    }


def _slept(done: Done) -> dict[str, Any]:
    return {"status": "sleeping", "level": done.args.level, "elapsed_ms": 1000 * done.seconds}


ROUTES = [
    # scheduling
    VerbRoute(
        "/pause",
        verbs.Pause,
        source="query",
        translate=_pause_args,
        consumes=frozenset({"wait_for_inflight_requests"}),
        answer=lambda d: {"status": "paused"},
    ),
    VerbRoute("/resume", verbs.Resume, answer=lambda d: {"status": "resumed"}),
    VerbRoute("/is_paused", verbs.IsPaused, "GET", answer=lambda d: {"is_paused": d.result}),
    VerbRoute(
        "/reset_prefix_cache",
        verbs.ResetPrefixCache,
        source="query",
        ignored=frozenset({"reset_external"}),
    ),
    # sleep
    VerbRoute("/sleep", verbs.Sleep, source="query", answer=_slept),
    VerbRoute("/wake_up", verbs.WakeUp, source="query", answer=_woken),
    VerbRoute("/is_sleeping", verbs.IsSleeping, "GET", answer=lambda d: {"is_sleeping": d.result}),
    # weight versions
    VerbRoute(
        "/weight_info", verbs.GetWeightInfo, "GET", answer=lambda d: weight_info_answer(d.result)
    ),
    VerbRoute(
        "/update_weight_version",
        verbs.UpdateWeightVersion,
        names={"new_version": "label"},
        answer=lambda d: {"success": True, "new_version": d.args.label},
    ),
    # weight transfer: the four phases (chunks: see update_weights below)
    VerbRoute(
        "/init_weight_transfer_engine",
        verbs.InitWeightTransfer,
        answer=lambda d: {"message": "Weight transfer initialized"},
    ),
    VerbRoute(
        "/start_weight_update",
        verbs.StartWeightUpdate,
        answer=lambda d: {"message": "Weight update started"},
    ),
    VerbRoute(
        "/prepare_weight_update",
        verbs.PrepareWeightUpdate,
        answer=lambda d: {"status": "prepared", "staged": d.result},
    ),
    VerbRoute(
        "/finish_weight_update",
        verbs.FinishWeightUpdate,
        translate=_finish_args,
        consumes=frozenset({"weight_label"}),
        answer=_finished,
    ),
    VerbRoute(
        "/get_world_size",
        verbs.GetWorldSize,
        "GET",
        source="query",
        ignored=frozenset({"include_dp"}),
        answer=lambda d: {"world_size": d.result},
    ),
]

ROUTES += [
    VerbRoute(
        "/collective_rpc",
        verbs.CollectiveRpc,
        ignored=frozenset({"timeout"}),  # the engine-side call cannot be interrupted
        answer=lambda d: {"results": d.result},
    ),
    VerbRoute(
        "/update_weight_label",
        verbs.UpdateWeightLabel,
        names={"weight_label": "label"},
        answer=lambda d: version_names(d.result),
    ),
    VerbRoute(
        "/weight_update_active",
        verbs.WeightUpdateActive,
        "GET",
        answer=lambda d: {"weight_update_active": d.result},
    ),
]

UPDATE_WEIGHTS = VerbRoute("/update_weights", verbs.UpdateWeights)

vllm_router = APIRouter()
add_verb_routes(vllm_router, ROUTES)


@vllm_router.post("/update_weights")
async def update_weights(request: Request) -> dict:
    """`{"update_info": {...}}`, `{"update_info": [{...}, ...]}` or a list of the former;
    every chunk is validated before the first is received, then received in order.
    prime-rl's `{"weight_dir": ...}` on the same path is a reload from that directory."""
    body = await json_object(request, allow_list=True)
    if isinstance(body, dict) and "weight_dir" in body:
        return await update_weights_from_dir(request, body)
    chunks, backend = [], info_backend(request, UPDATE_WEIGHTS.verb)
    for item in body if isinstance(body, list) else [body]:
        if not isinstance(item, dict):
            raise bad_request("body: must be a JSON object or a list of them", "body")
        info = item.get("update_info")
        for one in info if isinstance(info, list) and info else [info]:
            chunks.append(route_args(UPDATE_WEIGHTS, {"update_info": one}, backend))
    for chunk in chunks:
        await call_route(request, UPDATE_WEIGHTS, chunk)
    return {"message": "Weights updated"}


@vllm_router.post("/abort_requests")
async def abort_requests(request: Request) -> dict:
    """Abort the listed requests, or all when `request_ids` is absent or empty; does not
    pause. A front-end call (it maps request ids to the engine's), not an engine verb."""
    ids = (await json_object(request)).get("request_ids")
    if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, str) for i in ids)):
        raise bad_request("request_ids: must be a list of strings", "body.request_ids")
    aborted = await get_engine(request).abort(ids or None)
    return {"status": "aborted", "aborted": aborted}


WEIGHT_CHECKER_ACTIONS = ("checksum", "snapshot", "compare", "reset")


@vllm_router.post("/weight_checker")
async def weight_checker(request: Request) -> dict:
    """vLLM's weight checker over per-tensor SHA-256 checksums: `checksum` answers them;
    `compare` holds them against `baseline` (a checksums dict, upstream's form) or the
    last `snapshot` (the RL RFC's form); `reset` forgets the snapshot. (Upstream's reset
    also randomizes the weights to test a sync end to end; hotswap never does.)"""
    body = await json_object(request)
    action = body.get("action")
    if action not in WEIGHT_CHECKER_ACTIONS:
        raise bad_request(f"action: must be one of {', '.join(WEIGHT_CHECKER_ACTIONS)}, "
                          f"got {action!r}"[:300], "body.action")  # fmt: skip
    checker = dialect_sessions(request).weight_checker
    if action == "reset":
        checker.baseline = None
        return {"status": "reset"}
    baseline = body.get("baseline", checker.baseline)
    if action == "compare" and not isinstance(baseline, dict):
        raise bad_request("baseline: compare needs a checksums object (or a snapshot first)",
                          "body.baseline")  # fmt: skip
    checksums = await get_engine(request).get_weight_checksums()
    if action == "checksum":
        return {"checksums": checksums}
    if action == "snapshot":
        checker.baseline = checksums
        return {"status": "snapshotted", "n_tensors": len(checksums)}
    mismatches = sorted(k for k in checksums.keys() | baseline.keys()
                        if checksums.get(k) != baseline.get(k))  # fmt: skip
    return {"match": not mismatches, "mismatches": mismatches}
