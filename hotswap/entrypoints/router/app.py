"""`hotswap route URL [URL ...]`: one OpenAI-compatible front end over several `hotswap serve`
instances, routed as the data-parallel front end routes its ranks (upstreams.py).

- Generation (POST /v1/completions, /v1/chat/completions, /inference/v1/generate, SGLang's
  /generate) and GET /v1/models go to one upstream, named in the answer's
  `X-Hotswap-Upstream`; the upstream's status, headers and body come back unchanged, a
  stream chunk by chunk. A client that goes away cancels the upstream request. An upstream
  that refuses the connection is routed around for a few seconds (upstreams.DOWN_S) and
  the request goes to another; a pinned request, or one no upstream takes: 502 naming it.
- The control plane goes to every upstream (control.py), the weight-update rounds through
  one `EngineGroup` (weights.py): a commit is two-phase over all of them.
- /health: 200 when every upstream answers its /health with 200; /metrics: the routing
  counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import httpx
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import PlainTextResponse, StreamingResponse

from hotswap.entrypoints.router.control import add_control_routes
from hotswap.entrypoints.router.pool import Router, RouterConfig
from hotswap.entrypoints.router.upstreams import (
    UPSTREAM_HEADER,
    RoutingError,
    prometheus_text,
    prompt_key,
    request_hints,
)
from hotswap.entrypoints.router.weights import add_weight_routes
from hotswap.entrypoints.server.errors import error_response

__all__ = ["RouterConfig", "build_app", "run_router"]

ROUTED_POSTS = ("/v1/completions", "/v1/chat/completions", "/inference/v1/generate", "/generate")
# the router's own server adds its date and server headers
DROPPED_RESPONSE = frozenset(
    {"content-length", "connection", "transfer-encoding", "date", "server"}
)


def response_headers(response: httpx.Response, index: int) -> dict[str, str]:
    headers = {k: v for k, v in response.headers.items() if k.lower() not in DROPPED_RESPONSE}
    return {**headers, UPSTREAM_HEADER: str(index)}


async def forward(router: Router, request: Request) -> Response:
    """One request to the upstream the balancer picks (see the module docstring); one that
    refuses the connection (nothing reached it) is routed around and the next one tried,
    unless the request pinned it."""
    body = await request.body()
    try:
        parsed = json.loads(body) if body else None
    except ValueError:
        parsed = None  # the upstream refuses it with its own 400
    try:
        hints = request_hints(request.headers, parsed, len(router.urls))
    except RoutingError as e:
        return error_response(400, str(e), e.param)
    key = prompt_key(parsed)
    for attempt in range(len(router.urls)):
        index = router.balancer.acquire(hints, key)
        try:
            sending = router.http.send(router.upstream_request(index, request, body), stream=True)
            upstream = await until_disconnected(request, sending)
        except httpx.ConnectError as e:
            router.balancer.release(index)
            router.balancer.mark_down(index)
            if hints.pinned is not None or attempt + 1 == len(router.urls):
                return router.unreachable(index, e)
            continue
        except httpx.TransportError as e:
            router.balancer.release(index)
            return router.unreachable(index, e)
        return await answer(router, request, index, upstream)
    raise AssertionError("unreachable: the loop returns")


async def answer(
    router: Router, request: Request, index: int, upstream: httpx.Response | None
) -> Response:
    """The upstream's answer, relayed (a stream chunk by chunk); its slot released once
    the answer is done."""
    released = False
    try:
        if upstream is None:  # the client went away first
            return Response(status_code=499)
        if "text/event-stream" in upstream.headers.get("content-type", ""):
            released = True  # the stream releases it
            return StreamingResponse(relay(router, index, upstream), upstream.status_code,
                                     response_headers(upstream, index))  # fmt: skip
        try:
            content = await until_disconnected(request, upstream.aread())
        finally:
            await upstream.aclose()
        if content is None:
            return Response(status_code=499)
        return Response(content, upstream.status_code, response_headers(upstream, index))
    except httpx.TransportError as e:
        return router.unreachable(index, e)
    finally:
        if not released:
            router.balancer.release(index)


async def relay(router: Router, index: int, upstream: httpx.Response) -> AsyncIterator[bytes]:
    """A stream's chunks as they come; closed (the upstream request with it) when the
    client goes away, since Starlette then cancels this generator."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    finally:
        await upstream.aclose()
        router.balancer.release(index)


async def until_disconnected(request: Request, awaitable):  # noqa: ANN001, ANN201
    """`awaitable`'s result, or None (and it cancelled) if the client goes away first."""
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if work.done():
        return work.result()
    work.cancel()
    with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
        response = await work
        if isinstance(response, httpx.Response):
            await response.aclose()
    return None


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(urls: list[str], config: RouterConfig) -> FastAPI:
    router = Router(urls, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await router.http.aclose()

    app = FastAPI(title="hotswap router", lifespan=lifespan)
    app.state.router = router

    @app.middleware("http")
    async def check_key(request: Request, call_next):  # noqa: ANN001, ANN202
        key, open_paths = config.api_key, ("/health", "/metrics")
        given = request.headers.get("authorization")
        if key and request.url.path not in open_paths and given != f"Bearer {key}":
            return error_response(401, "invalid or missing API key (Bearer)")
        return await call_next(request)

    async def routed(request: Request) -> Response:
        return await forward(router, request)

    for path in ROUTED_POSTS:
        app.add_api_route(path, routed, methods=["POST"], include_in_schema=False)
    app.add_api_route("/v1/models", routed, methods=["GET"], include_in_schema=False)

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        stats = router.balancer.stats
        return PlainTextResponse(prometheus_text(stats, router.balancer.in_flight, router.urls))

    add_control_routes(app, router)
    add_weight_routes(app, router)
    return app


class _Server(uvicorn.Server):
    """Prints the URL once serving, as `hotswap serve` does (scripts wait for the line)."""

    def __init__(self, config: uvicorn.Config, url: str, count: int) -> None:
        super().__init__(config)
        self.url, self.count = url, count

    async def startup(self, sockets=None) -> None:  # noqa: ANN001
        await super().startup(sockets)
        if self.started:
            print(f"hotswap: serving a router over {self.count} upstreams at {self.url}",
                  flush=True)  # fmt: skip


def run_router(urls: list[str], config: RouterConfig) -> None:
    from hotswap.entrypoints.server.app import bind_socket

    sock = bind_socket(config.host, config.port)
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    app = build_app(urls, config)
    uv_config = uvicorn.Config(app, timeout_graceful_shutdown=5, access_log=False)
    _Server(uv_config, url, len(urls)).run(sockets=[sock])
