"""The router's upstreams: their URLs, one HTTP client to them, the balancer, and the
router's flags."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse

from hotswap.config import DP_ROUTING
from hotswap.entrypoints.router.upstreams import RANK_HEADER, Balancer
from hotswap.entrypoints.server.errors import error_response
from hotswap.flag_spec import arg

# Not forwarded: the connection's own, and the router's own pin (an upstream's index here).
DROPPED_REQUEST = frozenset({"host", "content-length", "connection", "transfer-encoding",
                             RANK_HEADER.lower()})  # fmt: skip


@dataclass(frozen=True)
class RouterConfig:
    host: str = arg("127.0.0.1", "address to listen on")
    port: int = arg(8000, "port to listen on (0: any free port)")
    dp_routing: str = arg(
        "session",
        "which upstream a request goes to (as --dp-routing of `hotswap serve`, with "
        "upstreams for ranks): session, cache-aware, least-loaded",
        choices=DP_ROUTING,
    )
    api_key: str | None = arg(
        None, "the key clients must give (Bearer); forwarded as given to the upstreams"
    )


class Router:
    """The upstreams, their HTTP client and the balancer."""

    def __init__(self, urls: list[str], config: RouterConfig) -> None:
        self.urls = [u.rstrip("/") for u in urls]
        self.config = config
        self.balancer = Balancer(config.dp_routing, len(self.urls))
        timeout = httpx.Timeout(None, connect=10.0)  # a generation may take any time
        self.http = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=None))

    def name(self, index: int) -> str:
        return f"upstream {index} ({self.urls[index]})"

    def unreachable(self, index: int, error: Exception) -> JSONResponse:
        message = f"{self.name(index)} cannot be reached: {type(error).__name__}: {error}"
        return error_response(502, message)

    def upstream_request(self, index: int, request: Request, body: bytes) -> httpx.Request:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in DROPPED_REQUEST}
        url = self.urls[index] + request.url.path
        return self.http.build_request(request.method, url, params=request.query_params,
                                       headers=headers, content=body)  # fmt: skip
