"""vLLM's runtime LoRA routes, POST /v1/load_lora_adapter and /v1/unload_lora_adapter
(vllm/entrypoints/serve/lora/api_router.py over OpenAIServingModels).

vLLM registers them only when the environment sets VLLM_ALLOW_RUNTIME_LORA_UPDATING=True;
hotswap registers them whenever the engine serves LoRA adapters (--enable-lora), since
that flag already says adapters come and go (`server/app.py` `build_app`). Their answers are
vLLM's: a plain-text 200 (`Success: LoRA adapter 'x' added successfully.`, no content
type, as vLLM's bare `Response`), or the error envelope: 400 for a missing name or path,
a name already loaded without `load_inplace` (`body.lora_name`) or an adapter the engine
refuses (`body.lora_path`: missing files, a rank above --max-lora-rank, shapes that do
not fit the model, a directory outside --allowed-weight-dirs); 404 to unload a name not
loaded; 409 when LoRA is off or every --max-cpu-loras slot is held by running requests.
A loaded adapter is then served as `model` on the OpenAI routes and listed by /v1/models.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request, Response

from hotswap.entrypoints.openai.params import UnknownFieldsRoute, served_model_name
from hotswap.entrypoints.openai.protocol import RequestModel
from hotswap.entrypoints.server.errors import APIError, bad_request
from hotswap.entrypoints.server.state import get_engine, get_lora_ids
from hotswap.errors import InvalidArgument
from hotswap.lora.modules import load_adapter, not_found

logger = logging.getLogger(__name__)

lora_router = APIRouter(route_class=UnknownFieldsRoute)  # unknown fields: warned or refused


class LoadLoRAAdapterRequest(RequestModel):
    """vLLM's LoadLoRAAdapterRequest (name and path are optional here so that their
    absence gets vLLM's own message rather than a validation error)."""

    lora_name: str | None = None
    lora_path: str | None = None
    load_inplace: bool = False
    # vLLM's flag for peft's 3-D adapters on stacked experts: accepted, not needed (the
    # adapter's own layout says it: lora/experts.py)
    is_3d_lora_weight: bool = False


class UnloadLoRAAdapterRequest(RequestModel):
    """vLLM's UnloadLoRAAdapterRequest: `lora_int_id` is accepted and ignored (vLLM
    unloads by name too)."""

    lora_name: str | None = None
    lora_int_id: int | None = None


def refusal(error: InvalidArgument) -> APIError:
    """An engine refusal as the envelope: 400 naming the field (`body.lora_name`,
    `body.lora_path`). A name not loaded is answered 404 before the engine is asked."""
    return bad_request(str(error), f"body.{error.field}" if error.field else None)


@lora_router.post("/v1/load_lora_adapter")
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> Response:
    if not body.lora_name or not body.lora_path:
        param = "body.lora_path" if body.lora_name else "body.lora_name"
        raise bad_request("Both 'lora_name' and 'lora_path' must be provided.", param)
    name, path = body.lora_name, body.lora_path
    try:
        await load_adapter(get_engine(request), served_model_name(request), name, path,
                           body.load_inplace)  # fmt: skip
    except InvalidArgument as e:
        raise refusal(e) from None
    get_lora_ids(request).of(name)
    logger.info("Loaded new LoRA adapter: name '%s', path '%s'", name, path)
    return Response(f"Success: LoRA adapter '{name}' added successfully.", status_code=200)


@lora_router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> Response:
    name = body.lora_name
    if not name:
        raise bad_request(
            "'lora_name' needs to be provided to unload a LoRA adapter.", "body.lora_name"
        )
    engine = get_engine(request)
    if name not in engine.loaded_adapters:
        raise APIError(404, not_found(name), "body.lora_name")
    try:
        await engine.unload_lora_adapter(name)
    except InvalidArgument as e:
        raise refusal(e) from None
    logger.info("Removed LoRA adapter: name '%s'", name)
    return Response(f"Success: LoRA adapter '{name}' removed successfully.", status_code=200)
