"""SGLang's request and load routes: `/abort_request` (a /generate rid, a batch's items,
or everything) and `GET /v1/loads` (SGLang's load report from the engine's stats).
Registered with the control plane."""

from __future__ import annotations

import datetime
import re
from typing import Any

from fastapi import APIRouter, Request, Response

import hotswap
from hotswap.engine import verbs
from hotswap.entrypoints.server.errors import bad_request
from hotswap.entrypoints.server.state import get_engine
from hotswap.entrypoints.server.verb_routes import VerbRoute, call_verb, read_body_fields
from hotswap.entrypoints.sglang.weights import flag

LOADS = VerbRoute("/v1/loads", verbs.GetStats, "GET")
ABORT_FIELDS = frozenset({"rid", "abort_all", "finished_reason", "abort_message"})
LOAD_SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})

sglang_admin_router = APIRouter()


# -- /abort_request ----------------------------------------------------------------------
@sglang_admin_router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    """Abort the request `rid` (a /generate rid; a batch's single rid names its
    `{rid}_{i}` items too), or every request with abort_all. Unknown rids are ignored, as
    SGLang does; its answer is an empty 200."""
    values = await read_body_fields(request, ABORT_FIELDS)
    rid = values.get("rid") or ""
    abort_all = flag(values, "abort_all", False)
    if not isinstance(rid, str):
        raise bad_request(f"rid: must be a string, got {rid!r}"[:200], "body.rid")
    engine = get_engine(request)
    if abort_all:
        await engine.abort()
    elif rid:
        batch = re.compile(re.escape(rid) + r"_[0-9]+")
        ids = [r for r in engine.processor.requests if r == rid or batch.fullmatch(r)]
        if ids:
            await engine.abort(ids)
    return Response(status_code=200)


# -- /v1/loads ---------------------------------------------------------------------------
@sglang_admin_router.get("/v1/loads")
async def get_loads(
    request: Request,
    dp_rank: int | None = None,
    include: str | None = None,
    format: str | None = None,  # noqa: A002 - SGLang's query parameter
) -> Any:
    """SGLang's load report: {timestamp, version, dp_rank_count, loads: [...], aggregate}.
    Only the core section is known here (running/waiting requests, KV tokens used and
    their share, prefix-cache hit rate); with data-parallel cores, one merged entry.
    format=prometheus gives the same numbers as text."""
    if include:
        sections = {s.strip() for s in include.split(",")}
        unknown = sorted(sections - LOAD_SECTIONS)
        if unknown:
            raise bad_request(f"include: unknown sections {unknown}; choose from "
                              f"{', '.join(sorted(LOAD_SECTIONS))}", "query.include")  # fmt: skip
    if format not in (None, "json", "prometheus"):
        raise bad_request("format: must be json or prometheus", "query.format")
    engine = get_engine(request)
    stats = (await call_verb(request, LOADS, verbs.GetStats)).result
    loads = [] if dp_rank not in (None, 0) else [_load(stats, engine.config)]
    if format == "prometheus":
        return _prometheus(loads)
    running = sum(load["num_running_reqs"] for load in loads)
    waiting = sum(load["num_waiting_reqs"] for load in loads)
    return {
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "version": hotswap.__version__,
        "dp_rank_count": len(loads),
        "loads": loads,
        "aggregate": {
            "total_running_reqs": running,
            "total_waiting_reqs": waiting,
            "total_reqs": running + waiting,
            "avg_token_usage": round(sum(load["token_usage"] for load in loads) / len(loads), 4)
            if loads
            else 0.0,
        },
    }


def _load(stats: dict[str, Any], config: Any) -> dict[str, Any]:
    block = config.cache.block_size
    blocks, free = int(stats["num_blocks"]), int(stats["num_free_blocks"])
    running, waiting = int(stats["num_running"]), int(stats["num_waiting"])
    return {
        "dp_rank": 0,
        "num_running_reqs": running,
        "num_waiting_reqs": waiting,
        "num_used_tokens": (blocks - free) * block,
        "max_total_num_tokens": blocks * block,
        "token_usage": float(stats["kv_usage"]),
        "cache_hit_rate": float(stats["prefix_cache_hit_rate"]),
        "max_running_requests": config.scheduler.max_num_seqs,
        "num_total_reqs": running + waiting,
    }


def _prometheus(loads: list[dict[str, Any]]) -> Response:
    lines = []
    for key in ("num_running_reqs", "num_waiting_reqs", "num_used_tokens",
                "max_total_num_tokens", "token_usage", "cache_hit_rate"):  # fmt: skip
        lines.append(f"# TYPE sglang_{key} gauge")
        lines.extend(f'sglang_{key}{{dp_rank="{load["dp_rank"]}"}} {load[key]}' for load in loads)
    return Response("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4; charset=utf-8")
