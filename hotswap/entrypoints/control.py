"""The RL control plane: vLLM's dev-mode routes (pause, resume, aborts, cache, weight
versions, sleep) and SGLang's aliases. Registered only with control enabled (404 otherwise).

Every route validates its input before calling the engine, so a refused call changes
nothing; the engine itself refuses state conflicts (409) the same way.
"""

from __future__ import annotations

import json
import time
from typing import Any

from fastapi import APIRouter, Query, Request
from pydantic import ConfigDict, StrictStr

from hotswap.engine.core import PAUSE_MODES
from hotswap.engine.sleep import SLEEP_LEVELS, SLEEP_TAGS
from hotswap.entrypoints.api_server import get_engine, get_metrics
from hotswap.entrypoints.errors import bad_request
from hotswap.entrypoints.limits import CheckedModel, check_json

control_router = APIRouter()
sglang_router = APIRouter()


def _check_mode(mode: str, param: str = "query.mode") -> str:
    if mode not in PAUSE_MODES:
        raise bad_request(f"mode: must be one of {', '.join(PAUSE_MODES)}, got {mode!r}", param)
    return mode


async def _pause(request: Request, mode: str, clear_cache: bool) -> None:
    start = time.perf_counter()
    await get_engine(request).pause_generation(mode, clear_cache)
    get_metrics(request).observe_pause(mode, time.perf_counter() - start)


async def _resume(request: Request) -> None:
    start = time.perf_counter()
    await get_engine(request).resume_generation()
    get_metrics(request).observe_resume(time.perf_counter() - start)


async def json_object(request: Request, allow_list: bool = False) -> Any:
    """An optional JSON object body (or list, if allowed): empty means {}. Strings are
    valid Unicode and nesting is bounded (see limits.json_problem)."""
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError:
        raise bad_request("Invalid JSON format", "body") from None
    except RecursionError:
        raise bad_request("body: JSON nested too deeply", "body") from None
    if not isinstance(body, dict) and not (allow_list and isinstance(body, list)):
        raise bad_request("body: must be a JSON object", "body")
    check_json(body)
    return body


# -- scheduling -------------------------------------------------------------------------------
@control_router.post("/pause")
async def pause(request: Request, mode: str = "abort", clear_cache: bool = True) -> dict:
    """Returns once the pause is complete (DESIGN §3): aborted outputs delivered (abort),
    running requests finished (wait), or the step in flight done (keep)."""
    await _pause(request, _check_mode(mode), clear_cache)
    return {"status": "paused"}


@control_router.post("/resume")
async def resume(request: Request) -> dict:
    await _resume(request)
    return {"status": "resumed"}


@control_router.get("/is_paused")
async def is_paused(request: Request) -> dict:
    return {"is_paused": await get_engine(request).is_paused()}


@control_router.post("/abort_requests")
async def abort_requests(request: Request) -> dict:
    """Abort the listed requests, or all when `request_ids` is absent or empty; does not
    pause."""
    ids = (await json_object(request)).get("request_ids")
    if ids is not None and (not isinstance(ids, list) or not all(isinstance(i, str) for i in ids)):
        raise bad_request("request_ids: must be a list of strings", "body.request_ids")
    aborted = await get_engine(request).abort(ids or None)
    return {"status": "aborted", "aborted": aborted}


@control_router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request, reset_running_requests: bool = False) -> dict:
    await get_engine(request).reset_prefix_cache(reset_running_requests)
    return {"success": True}


# -- weight versions --------------------------------------------------------------------------
class WeightVersionBody(CheckedModel):
    model_config = ConfigDict(extra="forbid")
    new_version: StrictStr


@control_router.get("/weight_info")
async def weight_info(request: Request) -> dict:
    info = await get_engine(request).get_weight_info()
    out = {"weight_version": info["label"], "version": info["version"], "digest": info["digest"]}
    if "rank_digests" in info:  # data-parallel ranks that disagree (digest is then null)
        out["rank_digests"] = info["rank_digests"]
    return out


@control_router.post("/update_weight_version")
async def update_weight_version(request: Request, body: WeightVersionBody) -> dict:
    if not body.new_version:
        raise bad_request("new_version: must be a non-empty string", "body.new_version")
    await get_engine(request).update_weight_version(body.new_version)
    return {"success": True, "new_version": body.new_version}


# -- sleep ------------------------------------------------------------------------------------
@control_router.post("/sleep")
async def sleep(request: Request, level: int = 1, mode: str = "abort") -> dict:
    if level not in SLEEP_LEVELS:
        raise bad_request(f"level: must be 0, 1 or 2, got {level}", "query.level")
    _check_mode(mode)
    start = time.perf_counter()
    await get_engine(request).sleep(level, mode)
    elapsed_ms = 1000 * (time.perf_counter() - start)
    return {"status": "sleeping", "level": level, "elapsed_ms": elapsed_ms}


@control_router.post("/wake_up")
async def wake_up(request: Request, tags: list[str] | None = Query(None)) -> dict:  # noqa: B008
    unknown = [t for t in tags or [] if t not in SLEEP_TAGS]
    if unknown:
        raise bad_request(f"tags: unknown {unknown}; choose from {SLEEP_TAGS}", "query.tags")
    start = time.perf_counter()
    result = await get_engine(request).wake_up(tags or None)
    return {
        "status": "sleeping" if result["is_sleeping"] else "awake",
        "tags_woken": result["tags_woken"] if tags else None,
        "elapsed_ms": 1000 * (time.perf_counter() - start),
    }


@control_router.get("/is_sleeping")
async def is_sleeping(request: Request) -> dict:
    return {"is_sleeping": await get_engine(request).is_sleeping()}


# -- SGLang dialect ---------------------------------------------------------------------------
# mode -> (hotswap pause mode, clear_cache)
SGLANG_PAUSE_MODES = {
    "abort": ("abort", True),
    "retract": ("keep", True),
    "in_place": ("keep", False),
}


@sglang_router.post("/pause_generation")
async def pause_generation(request: Request) -> dict:
    mode = (await json_object(request)).get("mode", "abort")
    if not isinstance(mode, str) or mode not in SGLANG_PAUSE_MODES:
        raise bad_request(
            f"mode: must be one of {', '.join(SGLANG_PAUSE_MODES)}, got {mode!r}", "body.mode"
        )
    await _pause(request, *SGLANG_PAUSE_MODES[mode])
    return {"status": "paused"}


@sglang_router.post("/continue_generation")
async def continue_generation(request: Request) -> dict:
    await _resume(request)
    return {"status": "resumed"}


@sglang_router.post("/flush_cache")
async def flush_cache(request: Request) -> dict:
    await get_engine(request).reset_prefix_cache()
    return {"success": True}


class DiskWeightsBody(CheckedModel):
    model_path: StrictStr
    weight_version: StrictStr | None = None
    load_format: StrictStr | None = None


@sglang_router.post("/update_weights_from_disk")
async def update_weights_from_disk(request: Request, body: DiskWeightsBody) -> dict:
    """Reload every weight from a safetensors directory between two steps, all or nothing;
    a refused checkpoint leaves the served weights untouched."""
    if body.load_format not in (None, "auto", "safetensors"):
        raise bad_request("load_format: only safetensors checkpoints", "body.load_format")
    info = await get_engine(request).load_weights_from_disk(body.model_path, body.weight_version)
    return {
        "success": True,
        "message": f"Weights loaded from {body.model_path}",
        "weight_version": info["label"],
        "version": info["version"],
    }


class MemoryTagsBody(CheckedModel):
    tags: list[StrictStr] | None = None


@sglang_router.post("/release_memory_occupation")
async def release_memory_occupation(request: Request, body: MemoryTagsBody | None = None) -> dict:
    """Sleep level 1 in keep mode: nothing in flight is lost; frozen requests recompute
    their KV after `resume_memory_occupation`. Only all of weights and KV can be released."""
    if body is not None and body.tags and set(body.tags) != {"weights", "kv_cache"}:
        raise bad_request("tags: only ['weights', 'kv_cache'] together", "body.tags")
    await get_engine(request).sleep(1, "keep")
    return {"success": True}


@sglang_router.post("/resume_memory_occupation")
async def resume_memory_occupation(request: Request, body: MemoryTagsBody | None = None) -> dict:
    tags = body.tags if body is not None and body.tags else None
    unknown = [t for t in tags or [] if t not in SLEEP_TAGS]
    if unknown:
        raise bad_request(f"tags: unknown {unknown}", "body.tags")
    if tags is not None and "scheduling" not in tags and set(tags) >= {"weights", "kv_cache"}:
        tags = [*tags, "scheduling"]  # SGLang has no scheduling tag: memory back = running
    result = await get_engine(request).wake_up(tags)
    return {"success": True, "is_sleeping": result["is_sleeping"]}
