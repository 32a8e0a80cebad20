"""Limits on what a caller can make the server do: the request body size, the API key,
what a JSON value may contain, request-supplied chat templates, and work that must not run
on the event loop. Bad input is refused before anything changes; nothing a request sends
may stall the other clients or end in a reset connection."""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, TypeVar

from fastapi import HTTPException, Request
from pydantic import BaseModel, field_validator
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hotswap.entrypoints.server.errors import bad_request, error_response

logger = logging.getLogger(__name__)

DEFAULT_MAX_REQUEST_BODY_BYTES = 32 << 20
MAX_JSON_DEPTH = 64  # far deeper than any legitimate body
MAX_FLOAT = 1e6  # OpenAI-route floats (temperature, top_p, penalties, ...)
OPEN_PATHS = frozenset({"/health"})  # answered without the API key

T = TypeVar("T")


class HTTPGuard:
    """The outermost middleware (plain ASGI: no per-chunk overhead on streams).

    - A body longer than `max_body_bytes` is refused 413: by its Content-Length before a
      byte is read, or as soon as a chunked body passes the limit.
    - With an API key, every path but /health needs `Authorization: Bearer KEY` (the
      scheme is case-insensitive, RFC 7235).
    - An exception that escapes the app becomes the JSON 500 envelope here. Starlette's
      own last-resort handler re-raises after answering, which makes the server drop the
      kept-alive connection, so a pooled client's next call would fail too."""

    def __init__(self, app: ASGIApp, max_body_bytes: int, api_key: str | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.api_key = api_key.encode() if api_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is not None:
            await refusal(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, self._limited(receive), tracking_send)
        except Exception as exc:
            if started:
                raise  # mid-response: nothing better can be sent
            logger.exception("unexpected error on %s %s", scope["method"], scope["path"])
            response = error_response(500, f"internal error: {type(exc).__name__}: {exc}")
            await response(scope, receive, send)

    def _refusal(self, scope: Scope):  # noqa: ANN202 - a JSONResponse or None
        headers = dict(scope["headers"])
        if (
            self.api_key is not None
            and scope["path"] not in OPEN_PATHS
            and not bearer_matches(headers.get(b"authorization", b""), self.api_key)
        ):
            return error_response(401, "Unauthorized: missing or wrong API key (Bearer token)")
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return error_response(413, self._too_large(), "body")
        return None

    def _limited(self, receive: Receive) -> Receive:
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    # FastAPI turns other errors while reading a body into a 400.
                    raise HTTPException(413, self._too_large())
            return message

        return limited

    def _too_large(self) -> str:
        return (
            f"body: request body larger than {self.max_body_bytes} bytes "
            f"(the server's --max-request-body-bytes)"
        )


def bearer_matches(header: bytes, key: bytes) -> bool:
    scheme, _, token = header.strip().partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key)


def json_problem(
    value: Any, path: str = "body", max_float: float | None = None
) -> tuple[str, str] | None:
    """(param, message) for the first thing in a parsed JSON value that no route can take:
    a string with a lone surrogate (not Unicode: it cannot be encoded, tokenized or sent to
    the engine), nesting deeper than MAX_JSON_DEPTH, or (with `max_float`) a number beyond
    +-max_float. Iterative: depth costs no stack."""
    stack = [(value, path, 0)]
    while stack:
        item, where, depth = stack.pop()
        problem = _scalar_problem(item, max_float)
        if problem is None and isinstance(item, (dict, list)) and depth >= MAX_JSON_DEPTH:
            problem = f"nested deeper than {MAX_JSON_DEPTH} levels"
        if problem is None and isinstance(item, dict):
            bad_key = any(isinstance(k, str) and not is_unicode(k) for k in item)
            problem = "a key contains a lone surrogate (not valid Unicode)" if bad_key else None
        if problem is not None:
            # The message names the field without the location's root ("body").
            label = where[len(path) :].lstrip(".") or path
            return where, f"{label if len(label) <= 80 else label[:77] + '...'}: {problem}"
        if isinstance(item, (dict, list)):
            if isinstance(item, dict):
                for key, sub in item.items():
                    stack.append((sub, f"{where}.{key}", depth + 1))
            elif not all(type(sub) is int for sub in item):  # token ids: nothing to check
                stack.extend((sub, f"{where}[{i}]", depth + 1) for i, sub in enumerate(item))
    return None


def _scalar_problem(item: Any, max_float: float | None) -> str | None:
    if isinstance(item, str) and not is_unicode(item):
        return "contains a lone surrogate (not valid Unicode)"
    if isinstance(item, float) and max_float is not None and not -max_float <= item <= max_float:
        return f"must be a finite number within +-{max_float:g}, got {item!r}"
    return None


class CheckedModel(BaseModel):
    """A request body whose every field holds valid Unicode, finite floats within
    +-MAX_FLOAT (beyond, a float32 sampler overflows: temperature 1e308 is infinity) and
    bounded nesting; a violation is a 400 naming the field."""

    @field_validator("*")
    @classmethod
    def _checked(cls, value: Any) -> Any:
        problem = json_problem(value, "", MAX_FLOAT)
        if problem is not None:  # pydantic names the field; this names the part of it
            raise ValueError(problem[1].removeprefix(": "))
        return value


def is_unicode(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def check_json(value: Any, path: str = "body") -> None:
    problem = json_problem(value, path)
    if problem is not None:
        param, message = problem
        raise bad_request(message, param)


def printable_field(name: str, limit: int = 80) -> str:
    """A request-supplied field name fit for a log line or an error body: lone surrogates
    escaped (they cannot be encoded), at most `limit` characters."""
    if not is_unicode(name):
        name = name.encode("utf-8", "backslashreplace").decode("utf-8")
    return name if len(name) <= limit else name[: limit - 3] + "..."


class WarningThrottle:
    """Keeps a warning that any request can cause (fields the server ignores) from flooding
    the log: each key is logged at most once per `interval_s`, and at most
    `max_per_interval` warnings are logged per `interval_s` in all (a client inventing new
    field names on every request). Only the `max_keys` most recently logged keys are
    remembered. Not thread-safe: called on the event loop."""

    def __init__(
        self,
        interval_s: float = 60.0,
        max_per_interval: int = 20,
        max_keys: int = 1024,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self.max_per_interval = max_per_interval
        self.max_keys = max_keys
        self._clock = clock
        self._keys: OrderedDict[str, list[float | int]] = OrderedDict()  # [logged at, held]
        self._window_start = float("-inf")
        self._window_logged = 0
        self._held_other = 0

    def admit(self, key: str) -> tuple[int, int] | None:
        """None: hold this warning back (it is counted). Otherwise log it, reporting the
        returned (repeats of this key held back since its last warning, other warnings
        held back by the overall cap since the last warning logged)."""
        now = self._clock()
        entry = self._keys.get(key)
        if entry is not None and now - entry[0] < self.interval_s:
            entry[1] += 1
            return None
        if now - self._window_start >= self.interval_s:
            self._window_start, self._window_logged = now, 0
        if self._window_logged >= self.max_per_interval:
            self._held_other += 1
            return None
        self._window_logged += 1
        held_same = int(entry[1]) if entry is not None else 0
        held_other, self._held_other = self._held_other, 0
        self._keys[key] = [now, 0]
        self._keys.move_to_end(key)
        while len(self._keys) > self.max_keys:
            self._keys.popitem(last=False)
        return held_same, held_other


def check_request_chat_template(request: Request, template: str | None, param: str) -> None:
    """A chat template in a request is code run by the server (a loop in it stalls a
    worker as long as it likes): refused unless the server trusts its callers."""
    if template is not None and not request.app.state.server_config.trust_request_chat_template:
        raise bad_request(
            "chat_template: request-supplied chat templates are refused; start the server "
            "with --trust-request-chat-template to allow them",
            param,
        )


async def off_loop(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run CPU-bound request work (tokenizing, rendering a chat template, detokenizing) on
    a worker thread: one long prompt must not stall /health and every other client."""
    return await asyncio.get_running_loop().run_in_executor(
        None, functools.partial(fn, *args, **kwargs)
    )


# A normalizer may drop some characters (strip, control characters): a margin over the
# longest token keeps the early refusal conservative.
CHARS_PER_TOKEN_MARGIN = 4
_MAX_TOKEN_CHARS: dict[int, int] = {}


def max_token_chars(tokenizer: Any) -> int:
    """Characters the longest vocabulary entry stands for (cached per tokenizer)."""
    key = id(tokenizer)
    if key not in _MAX_TOKEN_CHARS:
        vocab = tokenizer._backend.get_vocab(with_added_tokens=True)
        _MAX_TOKEN_CHARS[key] = max((len(token) for token in vocab), default=1)
    return _MAX_TOKEN_CHARS[key]


def check_prompt_chars(engine: Any, text: str, truncate: int | None, param: str) -> None:
    """Before tokenizing: a text too long to fit `max_model_len` tokens even if every
    token were the vocabulary's longest is refused without tokenizing it (tokenizing 50 MB
    takes a minute and gigabytes). A prompt to be truncated may be of any length."""
    if truncate is not None:
        return
    limit = engine.config.scheduler.max_model_len
    bound = limit * max_token_chars(engine.tokenizer) * CHARS_PER_TOKEN_MARGIN
    if len(text) > bound:
        raise bad_request(
            f"prompt: {len(text)} characters cannot fit in this model's maximum context "
            f"length of {limit} tokens",
            param,
        )
