"""HTTP errors: one envelope for every failure (OpenAI's shape, plus `param` as a dotted
location such as `query.mode` or `body.new_version`)."""

from __future__ import annotations

import http
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hotswap.engine.errors import EngineDeadError, EngineStateError
from hotswap.errors import InvalidArgument

logger = logging.getLogger(__name__)


class APIError(Exception):
    """Raised by a route: becomes the error envelope with this status."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param


def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """The envelope: {"error": {message, type, code, param}}."""
    return {"error": {"message": message, "type": _phrase(status), "code": status, "param": param}}


def _phrase(status: int) -> str:
    if status == 499:  # nginx's convention, also used by vLLM
        return "Client Closed Request"
    try:
        return http.HTTPStatus(status).phrase
    except ValueError:
        return "Error"


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def validation_param(loc: tuple[Any, ...] | list[Any]) -> str:
    return ".".join(str(part) for part in loc)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": ("body",), "msg": "invalid request", "type": ""}
    if first.get("type") == "json_invalid":
        return error_response(400, "Invalid JSON format", "body")
    param = validation_param(first.get("loc", ()))
    if first.get("type") == "missing":
        return error_response(400, f"{param}: required", param)
    return error_response(400, f"{param}: {first.get('msg', 'invalid value')}", param)


async def _api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.param)


async def _http_exception(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail))


async def _value_error(request: Request, exc: ValueError) -> JSONResponse:
    # a refusal names its field (InvalidArgument); no message is parsed for one
    param = exc.field if isinstance(exc, InvalidArgument) else None
    return error_response(400, str(exc), f"body.{param}" if param else None)


async def _state_error(request: Request, exc: EngineStateError) -> JSONResponse:
    return error_response(409, str(exc))


async def _engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
    return error_response(503, f"engine is not available: {exc}")


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unexpected error on %s %s", request.method, request.url.path)
    return error_response(500, f"internal error: {type(exc).__name__}: {exc}")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    app.add_exception_handler(EngineStateError, _state_error)
    app.add_exception_handler(ValueError, _value_error)
    app.add_exception_handler(EngineDeadError, _engine_dead)
    app.add_exception_handler(Exception, _unexpected)
