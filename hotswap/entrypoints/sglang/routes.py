"""SGLang's RL control routes (pause/continue, cache, disk reloads, memory release),
declared over the control verbs. Registered only with the control plane enabled; its
generation route is in sglang_generate.py."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from hotswap.engine import verbs
from hotswap.engine.errors import InvalidArgument
from hotswap.engine.verbs import SLEEP_TAGS
from hotswap.entrypoints.server.verb_routes import VerbRoute, add_verb_routes

# SGLang's pause mode -> (hotswap pause mode, clear_cache)
PAUSE_MODES = {
    "abort": ("abort", True),
    "retract": ("keep", True),
    "in_place": ("keep", False),
}


def _pause_args(values: dict[str, Any]) -> dict[str, Any]:
    mode = values.get("mode", "abort")
    if not isinstance(mode, str) or mode not in PAUSE_MODES:
        raise InvalidArgument("mode", f"mode: must be one of {', '.join(PAUSE_MODES)}, "
                              f"got {mode!r}")  # fmt: skip
    hotswap_mode, clear_cache = PAUSE_MODES[mode]
    return {"mode": hotswap_mode, "clear_cache": clear_cache}


def _disk_args(values: dict[str, Any]) -> dict[str, Any]:
    load_format = values.pop("load_format", None)
    if load_format not in (None, "auto", "safetensors"):
        raise InvalidArgument("load_format", "load_format: only safetensors checkpoints")
    return values


def _release_args(values: dict[str, Any]) -> dict[str, Any]:
    """Sleep level 1 in keep mode: nothing in flight is lost; frozen requests recompute
    their KV after a resume. Only weights and KV together can be released."""
    tags = values.get("tags")
    if tags and (not isinstance(tags, list) or set(tags) != {"weights", "kv_cache"}):
        raise InvalidArgument("tags", "tags: only ['weights', 'kv_cache'] together")
    return {"level": 1, "mode": "keep"}


def _resume_memory_args(values: dict[str, Any]) -> dict[str, Any]:
    tags = values.get("tags") or None
    if tags is None:
        return {}
    unknown = [t for t in tags if t not in SLEEP_TAGS] if isinstance(tags, list) else tags
    if unknown:
        raise InvalidArgument("tags", f"tags: unknown {unknown}")
    if "scheduling" not in tags and set(tags) >= {"weights", "kv_cache"}:
        tags = [*tags, "scheduling"]  # SGLang has no scheduling tag: memory back = running
    return {"tags": tags}


def _disk_answer(done: Any) -> dict[str, Any]:
    return {
        "success": True,
        "message": f"Weights loaded from {done.args.model_path}",
        "weight_version": done.result["label"],
        "version": done.result["version"],
    }


ROUTES = [
    VerbRoute(
        "/pause_generation",
        verbs.Pause,
        translate=_pause_args,
        answer=lambda d: {"status": "paused"},
    ),
    VerbRoute("/continue_generation", verbs.Resume, answer=lambda d: {"status": "resumed"}),
    VerbRoute("/flush_cache", verbs.ResetPrefixCache),
    VerbRoute("/flush_cache", verbs.ResetPrefixCache, "GET"),
    VerbRoute(
        "/update_weights_from_disk",
        verbs.LoadWeightsFromDisk,
        translate=_disk_args,
        consumes=frozenset({"load_format"}),
        answer=_disk_answer,
        ignored=frozenset({"flush_cache", "is_async", "torch_empty_cache", "keep_pause"}),
    ),
    VerbRoute(
        "/release_memory_occupation",
        verbs.Sleep,
        translate=_release_args,
        consumes=frozenset({"tags"}),
    ),
    VerbRoute(
        "/resume_memory_occupation",
        verbs.WakeUp,
        translate=_resume_memory_args,
        answer=lambda d: {"success": True, "is_sleeping": d.result["is_sleeping"]},
    ),
    VerbRoute(
        "/get_weight_version",
        verbs.GetWeightVersion,
        "GET",
        answer=lambda d: {"weight_version": d.result["label"]},
    ),
]

sglang_router = APIRouter()
add_verb_routes(sglang_router, ROUTES)
