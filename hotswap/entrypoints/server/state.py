"""What every route reads from the app: the server's configuration, the engine and the
metrics. A leaf module, so route modules never import the app that includes them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request

from hotswap.entrypoints.server.limits import DEFAULT_MAX_REQUEST_BODY_BYTES
from hotswap.lora.modules import AdapterIds, LoRAModulePath
from hotswap.structured_output import StructuredOutputsConfig

if TYPE_CHECKING:
    from hotswap.engine.async_llm import AsyncLLM
    from hotswap.entrypoints.server.metrics import ServerMetrics


@dataclass(frozen=True)
class ServerConfig:
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    enable_control: bool = False
    enable_prompt_tokens_details: bool = False
    log_level: str = "info"
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    # vLLM's flag: a chat template sent in a request is code the server runs.
    trust_request_chat_template: bool = False
    # vLLM's --return-tokens-as-token-ids: logprob tokens as "token_id:N" on every request
    return_tokens_as_token_ids: bool = False
    # Unknown request fields: ignored with a logged warning as vLLM does (False), or
    # refused with 400 naming the field (True, --reject-unknown-fields).
    reject_unknown_fields: bool = False
    # vLLM's tool calling and reasoning flags: tool_choice "auto" needs both of the first
    # two; the parsers are named as vLLM names them (parsers.TOOL_PARSERS / REASONING_PARSERS).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    structured_outputs: StructuredOutputsConfig = StructuredOutputsConfig()
    # vLLM's --lora-modules: adapters loaded before the server accepts requests
    lora_modules: tuple[LoRAModulePath, ...] = ()


def get_engine(request: Request) -> AsyncLLM:
    return request.app.state.engine


def get_server_config(request: Request) -> ServerConfig:
    return request.app.state.server_config


def get_metrics(request: Request) -> ServerMetrics:
    return request.app.state.metrics


def get_lora_ids(request: Request) -> AdapterIds:
    return request.app.state.lora_ids
