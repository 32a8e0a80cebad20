"""prime-rl's inference-server routes (src/prime_rl/inference/vllm/server.py), declared over
the control verbs. Registered only with the control plane enabled.

What prime-rl's orchestrator sends (src/prime_rl/utils/client.py):

- `POST /pause?mode=keep&clear_cache=false`, then `POST /update_weights
  {"weight_dir": ...}`, then `POST /resume`: vLLM's /pause and /resume serve the first and
  last; `/update_weights` is vLLM's chunk route too, so the vLLM dialect hands a body with
  `weight_dir` to `update_weights_from_dir` here: a disk reload of the HF checkpoint the
  trainer wrote there (its filesystem broadcast), confined to --allowed-weight-dirs.
- `GET /liveness`: the engine answers a no-op call in time (200), or not (503).
- `POST /init_broadcaster {"host", "port", "rank_offset", "inference_world_size",
  "timeout", ...}`: only for its NCCL/NIXL broadcast, whose wire (vLLM's
  StatelessProcessGroup and PyNccl, with pickled per-layer metadata) no hotswap backend
  speaks: refused with 501, so the orchestrator fails at once instead of its trainer
  waiting on a receiver that never comes.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from hotswap.engine import verbs
from hotswap.entrypoints.server.errors import APIError, bad_request
from hotswap.entrypoints.server.state import get_engine
from hotswap.entrypoints.server.verb_routes import (
    VerbRoute,
    call_route,
    json_object,
    read_values,
    route_args,
)

LIVENESS_TIMEOUT_S = 10.0

# `weight_dir` is the checkpoint directory; the committed version's label is that path.
UPDATE_FROM_DIR = VerbRoute(
    "/update_weights", verbs.LoadWeightsFromDisk, names={"weight_dir": "model_path"}
)


async def update_weights_from_dir(request: Request, body: dict[str, Any]) -> dict[str, str]:
    """prime-rl's `/update_weights {"weight_dir": ...}` (its body, already read, has
    `weight_dir`): reload every weight from that safetensors directory and commit."""
    if "update_info" in body:
        raise bad_request(
            "body: has both weight_dir (prime-rl's reload from a directory) and update_info "
            "(vLLM's weight chunk); send one",
            "body",
        )
    args = route_args(UPDATE_FROM_DIR, await read_values(request, UPDATE_FROM_DIR))
    await call_route(request, UPDATE_FROM_DIR, args)
    return {"status": "ok"}


prime_rl_router = APIRouter()


@prime_rl_router.get("/liveness")
async def liveness(request: Request) -> Any:
    """Whether the engine core answers a no-op call within LIVENESS_TIMEOUT_S."""
    try:
        await asyncio.wait_for(get_engine(request).is_paused(), LIVENESS_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - a dead engine is as unresponsive as a stuck one
        return JSONResponse({"status": "engine_unresponsive"}, status_code=503)
    return {"status": "ok"}


@prime_rl_router.post("/init_broadcaster")
async def init_broadcaster(request: Request) -> None:
    await json_object(request)  # a malformed body is still a 400
    raise APIError(
        501,
        "init_broadcaster: prime-rl's NCCL/NIXL weight broadcast (vLLM StatelessProcessGroup "
        "+ PyNccl, pickled per-layer metadata) is not supported; use its filesystem "
        'broadcast (weight_broadcast.type = "filesystem"): /update_weights {"weight_dir"} '
        "reloads the checkpoint it writes",
        "body",
    )
