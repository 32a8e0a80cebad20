"""The control plane at the router: every upstream in step.

POST /pause, /resume, /sleep, /wake_up, /reset_prefix_cache, /prepare_weight_update and
/update_weight_version go to every upstream at once (query and body as given) and are
answered once all did: the first upstream's answer when every one succeeded, else the
first failure's status with its message prefixed by the upstream's name (the others still
ran: e.g. after a failed /pause the upstreams that paused stay paused until /resume).
LoRA adapters (vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, SGLang's
/load_lora_adapter and /unload_lora_adapter) go to every upstream too; a load that any
upstream refuses is unloaded again from those that took it, so a routed request never
finds its adapter on one upstream and not on another.
POST /collective_rpc (vLLM's): every upstream's, their `results` in upstream order (each
upstream's own in its rank order).
GET /is_paused, /is_sleeping: true when every upstream is, with each one's answer under
`upstreams`. GET /weight_info: each upstream's under `upstreams`, and the common
`weight_version` and `digest` when they agree (else null). /health: 200 when every
upstream's is.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from hotswap.entrypoints.router.pool import Router
from hotswap.entrypoints.server.errors import error_body

FANNED_POSTS = ("/pause", "/resume", "/sleep", "/wake_up", "/reset_prefix_cache",
                "/prepare_weight_update", "/update_weight_version")  # fmt: skip
ALL_TRUE_GETS = {"/is_paused": "is_paused", "/is_sleeping": "is_sleeping"}
# adapter load route -> its unload route (the same dialect's)
LORA_LOADS = {"/v1/load_lora_adapter": "/v1/unload_lora_adapter",
              "/load_lora_adapter": "/unload_lora_adapter"}  # fmt: skip


async def on_all(router: Router, request: Request, body: bytes) -> list[httpx.Response | Exception]:
    """`request` sent to every upstream at once; each one's answer or transport error."""

    async def one(index: int) -> httpx.Response | Exception:
        try:
            return await router.http.send(router.upstream_request(index, request, body))
        except httpx.TransportError as e:
            return e

    return list(await asyncio.gather(*(one(i) for i in range(len(router.urls)))))


def first_failure(router: Router, answers: list[httpx.Response | Exception]) -> Response | None:
    """The first upstream's failure as the router's answer (its name in the message)."""
    for index, answer in enumerate(answers):
        if isinstance(answer, Exception):
            return router.unreachable(index, answer)
        if not answer.is_success:
            body = _json(answer)
            error = body.get("error") if isinstance(body, dict) else None
            if isinstance(error, dict):
                message = f"{router.name(index)}: {error.get('message')}"
                body = {"error": {**error, "message": message}}
            else:
                body = error_body(answer.status_code, f"{router.name(index)}: {answer.text}")
            return JSONResponse(body, answer.status_code)
    return None


def passed_on(answer: httpx.Response | Exception) -> Response:
    """An upstream's answer as the router's (status, body and content type)."""
    assert isinstance(answer, httpx.Response)
    return Response(answer.content, answer.status_code,
                    media_type=answer.headers.get("content-type"))  # fmt: skip


def forwarded_auth(request: Request) -> dict[str, str]:
    """The client's credentials, for a request the router makes on its behalf."""
    auth = request.headers.get("authorization")
    return {"authorization": auth} if auth else {}


def _json_bytes(body: bytes) -> Any:
    try:
        return json.loads(body) if body else None
    except ValueError:
        return None


def _json(answer: httpx.Response) -> Any:
    try:
        return answer.json()
    except ValueError:
        return None


def add_control_routes(app: FastAPI, router: Router) -> None:
    async def fanned(request: Request) -> Response:
        answers = await on_all(router, request, await request.body())
        failure = first_failure(router, answers)
        return failure if failure is not None else passed_on(answers[0])

    async def all_true(request: Request) -> Response:
        answers = await on_all(router, request, b"")
        failure = first_failure(router, answers)
        if failure is not None:
            return failure
        name = ALL_TRUE_GETS[request.url.path]
        each = [a.json() for a in answers if isinstance(a, httpx.Response)]
        return JSONResponse({name: all(a.get(name) is True for a in each), "upstreams": each})

    async def weight_info(request: Request) -> Response:
        answers = await on_all(router, request, b"")
        failure = first_failure(router, answers)
        if failure is not None:
            return failure
        each = [a.json() for a in answers if isinstance(a, httpx.Response)]
        common = {}
        for key in ("weight_version", "digest"):
            values = {json.dumps(a.get(key)) for a in each}
            common[key] = each[0].get(key) if len(values) == 1 else None
        return JSONResponse({**common, "upstreams": each})

    async def health(request: Request) -> Response:
        answers = await on_all(router, request, b"")
        states = [a.status_code if isinstance(a, httpx.Response) else f"{type(a).__name__}: {a}"
                  for a in answers]  # fmt: skip
        healthy = all(s == 200 for s in states)
        upstreams = [{"url": u, "status": s} for u, s in zip(router.urls, states)]
        return JSONResponse({"healthy": healthy, "upstreams": upstreams}, 200 if healthy else 503)

    for path in (*FANNED_POSTS, *LORA_LOADS.values()):
        app.add_api_route(path, fanned, methods=["POST"], include_in_schema=False)
    add_merged_routes(app, router)
    for path in ALL_TRUE_GETS:
        app.add_api_route(path, all_true, methods=["GET"], include_in_schema=False)
    app.add_api_route("/weight_info", weight_info, methods=["GET"], include_in_schema=False)
    app.add_api_route("/health", health, methods=["GET"], include_in_schema=False)


def add_merged_routes(app: FastAPI, router: Router) -> None:
    """The fanned routes whose answers are more than the first one's: an adapter load
    (undone where it took when another upstream refused it) and /collective_rpc."""

    async def load_adapter(request: Request) -> Response:
        body = await request.body()
        answers = await on_all(router, request, body)
        failure = first_failure(router, answers)
        if failure is None:
            return passed_on(answers[0])
        took = [i for i, a in enumerate(answers) if isinstance(a, httpx.Response) and a.is_success]
        parsed = _json_bytes(body)
        name = parsed.get("lora_name") if isinstance(parsed, dict) else None
        unload = LORA_LOADS[request.url.path]
        await asyncio.gather(*(router.http.post(router.urls[i] + unload, json={"lora_name": name},
                                                headers=forwarded_auth(request))
                               for i in took))  # fmt: skip
        return failure

    async def collective_rpc(request: Request) -> Response:
        answers = await on_all(router, request, await request.body())
        failure = first_failure(router, answers)
        if failure is not None:
            return failure
        each = [a.json() for a in answers if isinstance(a, httpx.Response)]
        return JSONResponse({"results": [r for answer in each for r in answer["results"]]})

    for path in LORA_LOADS:
        app.add_api_route(path, load_adapter, methods=["POST"], include_in_schema=False)
    app.add_api_route("/collective_rpc", collective_rpc, methods=["POST"],
                      include_in_schema=False)  # fmt: skip
