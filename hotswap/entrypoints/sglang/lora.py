"""SGLang's LoRA routes, POST /load_lora_adapter {lora_name, lora_path, pinned?} and
/unload_lora_adapter {lora_name} (python/sglang/srt/entrypoints/http_server.py), over the
same adapters as vLLM's /v1/load_lora_adapter; registered, like those, when the engine
serves LoRA adapters (--enable-lora). A loaded adapter is named per request by
/generate's `lora_path` (sglang_request.py).

SGLang answers both with its LoRAUpdateOutput: {"success": true, "error_message": "",
"loaded_adapters": {name: path}}. A refusal is hotswap's error envelope (400 naming the
field, `body.lora_path` for an adapter the engine cannot load; 404 to unload a name not
loaded; 409 when every --max-cpu-loras slot is held by running requests) with SGLang's
fields beside it ("success": false, "error_message", "loaded_adapters"), so a client
reading either form finds the failure. `pinned` is accepted and ignored: hotswap re-reads
an adapter it had to set aside when a request names it again.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from hotswap.engine.errors import EngineStateError
from hotswap.entrypoints.openai.lora_routes import refusal
from hotswap.entrypoints.openai.params import served_model_name
from hotswap.entrypoints.server.errors import APIError, bad_request, error_body
from hotswap.entrypoints.server.state import get_engine, get_lora_ids
from hotswap.entrypoints.server.verb_routes import read_body_fields
from hotswap.errors import InvalidArgument
from hotswap.lora.modules import load_adapter, not_found

LOAD_FIELDS = frozenset({"lora_name", "lora_path", "pinned", "lora_id"})
UNLOAD_FIELDS = frozenset({"lora_name", "lora_id"})

sglang_lora_router = APIRouter()


def _answer(request: Request, error: APIError | None = None) -> Any:
    """SGLang's LoRAUpdateOutput, in hotswap's envelope for a refusal."""
    loaded = get_engine(request).loaded_adapters
    if error is None:
        return {"success": True, "error_message": "", "loaded_adapters": loaded}
    body = {"success": False, "error_message": error.message, "loaded_adapters": loaded}
    body |= error_body(error.status, error.message, error.param)
    return JSONResponse(body, status_code=error.status)


def _name(values: dict[str, Any], field: str) -> str:
    value = values.get(field)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{field}: required, a non-empty string", f"body.{field}")
    return value


@sglang_lora_router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Any:
    values = await read_body_fields(request, LOAD_FIELDS)
    name, path = _name(values, "lora_name"), _name(values, "lora_path")
    if not isinstance(values.get("pinned", False), bool):
        raise bad_request("pinned: must be a boolean", "body.pinned")
    try:
        await load_adapter(get_engine(request), served_model_name(request), name, path, False)
    except InvalidArgument as e:
        return _answer(request, refusal(e))
    except EngineStateError as e:
        return _answer(request, APIError(409, str(e)))
    get_lora_ids(request).of(name)
    return _answer(request)


@sglang_lora_router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Any:
    name = _name(await read_body_fields(request, UNLOAD_FIELDS), "lora_name")
    engine = get_engine(request)
    if name not in engine.loaded_adapters:
        return _answer(request, APIError(404, not_found(name), "body.lora_name"))
    try:
        await engine.unload_lora_adapter(name)
    except InvalidArgument as e:
        return _answer(request, refusal(e))
    return _answer(request)
