"""The weight-update rounds at the router: one `EngineGroup` over an `HTTPWeightSyncClient`
per upstream (hotswap/rl/engine_group.py), so a trainer that treats the router as one
engine updates every upstream, and its commit is two-phase: every upstream prepares, then
all commit, or all abort and keep their previous weights.

GET /get_world_size is the upstreams' receiving workers together (a broadcast group is that
+ 1); POST /init_weight_transfer_engine gives each upstream its rank offset;
/start_weight_update, /update_weights (one chunk or a list, as `hotswap serve` takes them)
and /finish_weight_update run on all. A commit answers with the common label and version
(`version` null if the upstreams count differently) and each upstream's answer under
`engines`. The group is built at the first of these calls (it asks each upstream its world
size); the calls run one at a time.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from hotswap.entrypoints.router.pool import Router
from hotswap.entrypoints.server.errors import error_response
from hotswap.errors import InvalidArgument
from hotswap.rl.engine_group import EngineGroup
from hotswap.weight_transfer.clients import HTTPWeightSyncClient, WeightSyncError

FINISH_FIELDS = ("weight_version", "abort", "digest", "checksum", "kv_policy")


class WeightRounds:
    """The router's EngineGroup, built on first use; its calls run one at a time, each in a
    thread (the group's clients block)."""

    def __init__(self, router: Router) -> None:
        self.router = router
        self.group: EngineGroup | None = None
        self.lock = asyncio.Lock()

    async def call(self, method: str, **arguments: Any) -> Any:
        async with self.lock:
            group = await self._group()
            return await asyncio.to_thread(getattr(group, method), **arguments)

    async def num_workers(self) -> int:
        async with self.lock:
            return (await self._group()).num_workers

    async def _group(self) -> EngineGroup:
        if self.group is None:
            self.group = await asyncio.to_thread(self._build)
        return self.group

    def _build(self) -> EngineGroup:
        key = self.router.config.api_key
        return EngineGroup([HTTPWeightSyncClient(url, key) for url in self.router.urls])


def finish_arguments(body: dict[str, Any]) -> dict[str, Any]:
    """/finish_weight_update's body as EngineGroup.finish_weight_update's arguments
    (`weight_label`, vLLM's RFC's name, is the label too)."""
    unknown = sorted(set(body) - {*FINISH_FIELDS, "weight_label"})
    if unknown:
        raise InvalidArgument(unknown[0], f"{unknown[0]}: not a field of /finish_weight_update")
    arguments = {k: body[k] for k in FINISH_FIELDS if k in body}
    label = body.get("weight_label")
    if label is not None:
        if arguments.get("weight_version", label) != label:
            raise InvalidArgument("weight_label", "weight_label: differs from weight_version")
        arguments["weight_version"] = label
    return arguments


def committed_answer(committed: Any) -> dict[str, Any]:
    if committed is None:
        return {"message": "Weight update aborted"}
    engines = [None if e is None else {"weight_version": e.label, "version": e.version,
                                       "digest": e.digest} for e in committed.engines]  # fmt: skip
    common = {"weight_version": committed.label, "version": committed.version,
              "digest": committed.digest}  # fmt: skip
    return {"message": "Weight update finished", **common, "engines": engines}


def update_chunks(body: object) -> list[Any]:
    """Each chunk's update_info, as `hotswap serve` reads /update_weights."""
    chunks = []
    for item in body if isinstance(body, list) else [body]:
        if not isinstance(item, dict):
            raise InvalidArgument("body", "body: must be a JSON object or a list of them")
        info = item.get("update_info")
        chunks += info if isinstance(info, list) and info else [info]
    return chunks


def add_weight_routes(app: FastAPI, router: Router) -> None:
    rounds = WeightRounds(router)

    async def guarded(call) -> JSONResponse:  # noqa: ANN001
        try:
            return JSONResponse(await call())
        except (InvalidArgument, ValueError) as e:
            return error_response(400, str(e), getattr(e, "param", None))
        except WeightSyncError as e:  # EngineGroupError names the upstreams at fault
            return error_response(e.status if e.status else 502, str(e))

    async def body_of(request: Request) -> Any:
        try:
            return await request.json()
        except ValueError:
            raise InvalidArgument("body", "body: not JSON") from None

    @app.get("/get_world_size")
    async def world_size() -> JSONResponse:
        async def run() -> dict:
            return {"world_size": await rounds.num_workers()}

        return await guarded(run)

    @app.post("/init_weight_transfer_engine")
    async def init(request: Request) -> JSONResponse:
        async def run() -> dict:
            body = await body_of(request)
            await rounds.call("init_weight_transfer_engine", init_info=body.get("init_info"))
            return {"message": "Weight transfer initialized"}

        return await guarded(run)

    @app.post("/start_weight_update")
    async def start(request: Request) -> JSONResponse:
        async def run() -> dict:
            body = await body_of(request)
            arguments = {k: body[k] for k in ("is_checkpoint_format", "lora_name", "lora_config")
                         if k in body}  # fmt: skip
            await rounds.call("start_weight_update", **arguments)
            return {"message": "Weight update started"}

        return await guarded(run)

    @app.post("/update_weights")
    async def update(request: Request) -> JSONResponse:
        async def run() -> dict:
            for info in update_chunks(await body_of(request)):
                await rounds.call("update_weights", update_info=info)
            return {"message": "Weights updated"}

        return await guarded(run)

    @app.post("/finish_weight_update")
    async def finish(request: Request) -> JSONResponse:
        async def run() -> dict:
            arguments = finish_arguments(await body_of(request))
            return committed_answer(await rounds.call("finish_weight_update", **arguments))

        return await guarded(run)
