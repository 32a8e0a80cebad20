"""A request's data-parallel routing hints over HTTP (engine/dp_router.py, `--dp-routing`).

- The session key: vLLM router's `X-Session-ID` header, else the body's own spelling of it
  (`session_id` on the OpenAI routes and /inference/v1/generate, SGLang's `routing_key`);
  a session's turns then go to the rank holding its earlier turns' KV.
- An explicit rank: vLLM's `X-data-parallel-rank` header (as vLLM, a value that is not an
  integer is ignored), else SGLang's `data_parallel_rank`; out of range: 400.

The header wins over the body, as a router in front of the server sets it.
"""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from hotswap.engine.prompts import MAX_SESSION_ID_CHARS, is_session_id
from hotswap.entrypoints.server.errors import bad_request
from hotswap.entrypoints.server.state import get_engine

SESSION_HEADER = "X-Session-ID"
RANK_HEADER = "X-data-parallel-rank"


@dataclass(frozen=True)
class Routing:
    session_id: str | None = None
    data_parallel_rank: int | None = None


def request_routing(
    request: Request, session_id: str | None = None, rank: int | None = None
) -> Routing:
    """The hints of `request`, its headers over the body's `session_id` and `rank`
    (checked already where the body was read); a 400 naming the header at fault."""
    header = request.headers.get(SESSION_HEADER)
    if header is not None and not is_session_id(header):
        raise bad_request(f"{SESSION_HEADER}: must be 1 to {MAX_SESSION_ID_CHARS} characters",
                          SESSION_HEADER)  # fmt: skip
    pinned, param = rank, "body.data_parallel_rank"
    text = request.headers.get(RANK_HEADER)
    if text is not None and text.strip().lstrip("+-").isdigit():
        pinned, param = int(text), RANK_HEADER
    size = get_engine(request).data_parallel_size
    if pinned is not None and not 0 <= pinned < size:
        name = param.removeprefix("body.")
        raise bad_request(f"{name}: {pinned} is out of range [0, {size})", param)
    return Routing(header if header is not None else session_id, pinned)
