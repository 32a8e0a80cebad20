"""`hotswap serve`: the FastAPI app (OpenAI API, RL control plane, metrics) and its server.

The engine core runs in its own process; this process tokenizes, streams and answers HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys

import uvicorn
from fastapi import APIRouter, FastAPI, Request, Response

from hotswap.engine.async_llm import AsyncLLM
from hotswap.entrypoints.areal.routes import areal_router
from hotswap.entrypoints.openai.lora_routes import lora_router
from hotswap.entrypoints.openai.routes import openai_router
from hotswap.entrypoints.pipelinerl.routes import pipelinerl_router
from hotswap.entrypoints.prime_rl.routes import prime_rl_router
from hotswap.entrypoints.server.errors import error_response, install_error_handlers
from hotswap.entrypoints.server.limits import HTTPGuard
from hotswap.entrypoints.server.metrics import ServerMetrics
from hotswap.entrypoints.server.sessions import DialectSessions
from hotswap.entrypoints.server.state import ServerConfig, get_engine, get_metrics
from hotswap.entrypoints.sglang.admin import sglang_admin_router
from hotswap.entrypoints.sglang.generate import sglang_generate_router
from hotswap.entrypoints.sglang.lora import sglang_lora_router
from hotswap.entrypoints.sglang.routes import sglang_router
from hotswap.entrypoints.sglang.weights import sglang_weights_router
from hotswap.entrypoints.trl.routes import trl_router
from hotswap.entrypoints.vllm.routes import vllm_router
from hotswap.lora.modules import AdapterIds, load_lora_modules

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 10.0


basic_router = APIRouter()


@basic_router.get("/health")
async def health(request: Request) -> Response:
    """200 once the engine core answers a call; 503 when it is dead or stuck."""
    try:
        await asyncio.wait_for(get_engine(request).is_paused(), HEALTH_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - any failure means "not healthy"
        return error_response(503, f"engine is not available: {type(e).__name__}: {e}")
    return Response(status_code=200)


@basic_router.get("/metrics")
async def metrics(request: Request) -> Response:
    body = await get_metrics(request).render(get_engine(request))
    return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


def build_app(engine: AsyncLLM, config: ServerConfig) -> FastAPI:
    app = FastAPI(title="hotswap", version="0.1.0")
    app.state.engine = engine
    app.state.server_config = config
    app.state.metrics = ServerMetrics(config.served_model_name)
    app.state.dialect_sessions = DialectSessions()  # the dialects' weight-plane sessions
    app.state.lora_ids = AdapterIds()  # a stable lora_int_id per adapter name
    install_error_handlers(app)
    app.add_middleware(
        HTTPGuard, max_body_bytes=config.max_request_body_bytes, api_key=config.api_key
    )
    app.include_router(basic_router)
    # Control routes first: Starlette tries routes in order, and a control call is a few
    # milliseconds end to end (each route passed costs a few microseconds), while
    # generation requests take far longer than the routes before them.
    if config.enable_control:
        for router in (vllm_router, sglang_router, sglang_weights_router, sglang_admin_router,
                       prime_rl_router, pipelinerl_router, areal_router):  # fmt: skip
            app.include_router(router)
    if engine is not None and engine.config.lora is not None:
        # vLLM's runtime LoRA routes (it asks for VLLM_ALLOW_RUNTIME_LORA_UPDATING; here
        # --enable-lora is enough) and SGLang's: see lora_routes.py and sglang_lora.py
        app.include_router(lora_router)
        app.include_router(sglang_lora_router)
    app.include_router(openai_router)
    app.include_router(sglang_generate_router)  # SGLang serves /generate without a flag
    app.include_router(trl_router)  # its weight routes check --enable-control
    return app


class _Server(uvicorn.Server):
    """Prints the URL once the socket is serving (tests and scripts wait for that line)."""

    def __init__(self, config: uvicorn.Config, url: str, model: str) -> None:
        super().__init__(config)
        self.url = url
        self.model = model

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            print(f"hotswap: serving {self.model} at {self.url}", flush=True)


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


async def _serve(
    server: _Server, sock: socket.socket, engine: AsyncLLM, config: ServerConfig
) -> None:
    """Load the --lora-modules adapters (a failure raises: the server never starts),
    then serve on `sock`."""
    await load_lora_modules(engine, config.served_model_name, config.lora_modules)
    await server.serve(sockets=[sock])


def run_server(config: ServerConfig, model: str | None, engine_kwargs: dict) -> None:
    """Bind first (port 0 picks a free port), start the engine process, then serve until
    Ctrl-C / SIGTERM; the engine process is always shut down on the way out."""
    sock = bind_socket(config.host, config.port)
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    engine = AsyncLLM(model, multiprocess=True, **engine_kwargs)
    try:
        app = build_app(engine, config)
        uv_config = uvicorn.Config(
            app, log_level=config.log_level, timeout_graceful_shutdown=5, access_log=False
        )
        server = _Server(uv_config, url, config.served_model_name)
        # uvicorn re-raises the Ctrl-C / SIGTERM it caught once it has shut down; both
        # end here, so the engine process is always shut down below.
        signal.signal(signal.SIGTERM, _interrupt)
        with contextlib.suppress(KeyboardInterrupt):
            asyncio.run(_serve(server, sock, engine, config))
    finally:
        engine.shutdown()
        sock.close()
    print("hotswap: server stopped", file=sys.stderr, flush=True)
