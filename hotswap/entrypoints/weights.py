"""Weight-transfer routes (control plane): the four phases and the worker count. Only
JSON metadata arrives here; tensors take the configured backend's data plane."""

from __future__ import annotations

from fastapi import APIRouter, Request

from hotswap.entrypoints.api_server import get_engine
from hotswap.entrypoints.control import json_object
from hotswap.entrypoints.errors import bad_request

weights_router = APIRouter()


@weights_router.post("/init_weight_transfer_engine")
async def init_weight_transfer_engine(request: Request) -> dict:
    init_info = (await json_object(request)).get("init_info")
    if not isinstance(init_info, dict):
        raise bad_request("init_info: required, a JSON object", "body.init_info")
    await get_engine(request).init_weight_transfer_engine(init_info)
    return {"message": "Weight transfer initialized"}


@weights_router.post("/start_weight_update")
async def start_weight_update(request: Request) -> dict:
    flag = (await json_object(request)).get("is_checkpoint_format", True)
    if not isinstance(flag, bool):
        raise bad_request("is_checkpoint_format: must be a boolean", "body.is_checkpoint_format")
    await get_engine(request).start_weight_update(flag)
    return {"message": "Weight update started"}


@weights_router.post("/update_weights")
async def update_weights(request: Request) -> dict:
    """`{"update_info": {...}}`, `{"update_info": [{...}, ...]}` or a list of the former;
    chunks are received in order."""
    body = await json_object(request, allow_list=True)
    items = body if isinstance(body, list) else [body]
    infos = []
    for item in items:
        info = item.get("update_info") if isinstance(item, dict) else None
        chunk = info if isinstance(info, list) else [info]
        if not chunk or not all(isinstance(i, dict) for i in chunk):
            raise bad_request("update_info: required, a JSON object or a list of them",
                              "body.update_info")  # fmt: skip
        infos.extend(chunk)
    engine = get_engine(request)
    for info in infos:
        await engine.update_weights(info)
    return {"message": "Weights updated"}


@weights_router.post("/prepare_weight_update")
async def prepare_weight_update(request: Request) -> dict:
    """hotswap extension, phase one of a commit across engines: refuses (400 / 409) what
    /finish_weight_update would, applies nothing; the round stays open."""
    return {"status": "prepared", "staged": await get_engine(request).prepare_weight_update()}


@weights_router.post("/finish_weight_update")
async def finish_weight_update(request: Request) -> dict:
    body = await json_object(request)
    version = body.get("weight_version")
    if version is not None and (not isinstance(version, str) or not version):
        raise bad_request("weight_version: must be a non-empty string", "body.weight_version")
    abort = body.get("abort", False)
    if not isinstance(abort, bool):
        raise bad_request("abort: must be a boolean", "body.abort")
    digest = body.get("digest", False)  # hotswap extension: also hash the committed weights
    if not isinstance(digest, bool):
        raise bad_request("digest: must be a boolean", "body.digest")
    info = await get_engine(request).finish_weight_update(version, abort, digest)
    if abort:
        return {"message": "Weight update aborted"}
    # What this call committed, in /weight_info's shape (a later /weight_info may already
    # name another commit).
    return {"message": "Weight update finished", "weight_version": info["label"],
            "version": info["version"], "digest": info["digest"]}  # fmt: skip


@weights_router.get("/get_world_size")
async def get_world_size(request: Request, include_dp: bool = True) -> dict:
    """Receiving workers: one per data-parallel rank (the trainer's group is this + 1)."""
    return {"world_size": await get_engine(request).get_world_size()}
