"""What every route reads from the app: the server's configuration (whose fields declare
`hotswap serve`'s server flags), the engine and the metrics. A leaf module, so route
modules never import the app that includes them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from fastapi import Request

from hotswap.entrypoints.server.limits import DEFAULT_MAX_REQUEST_BODY_BYTES
from hotswap.flag_spec import arg
from hotswap.lora.modules import AdapterIds, LoRAModulePath, parse_lora_modules
from hotswap.structured_output import StructuredOutputsConfig

if TYPE_CHECKING:
    from hotswap.engine.async_llm import AsyncLLM
    from hotswap.entrypoints.server.metrics import ServerMetrics


# The server's flags (`hotswap serve`'s "server" group) are these fields' Flags, in field
# order, which is the order of --help (kw_only lets a field without a default, the served
# name, sit among them). A flag with its own `cli_type` is text the field holds parsed.
@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    host: str = arg("127.0.0.1")
    port: int = arg(8000, "0 picks a free port")
    # Also --api-key-file and the environment (cli.server_config resolves them).
    api_key: str | None = arg(
        None,
        "require `Authorization: Bearer KEY` (or set $HOTSWAP_API_KEY / $VLLM_API_KEY, "
        "or --api-key-file: a command line is visible to every local user)",
    )
    # The flag's absence means the model's name (cli.server_config).
    served_model_name: str = arg(cli_type=str | None)
    # Also HOTSWAP_SERVER_DEV_MODE (cli.server_config).
    enable_control: bool = arg(
        False,
        "RL control plane (pause/resume, weights, sleep); also HOTSWAP_SERVER_DEV_MODE=1",
        action="store_true",
    )
    enable_prompt_tokens_details: bool = arg(
        False, "report usage.prompt_tokens_details.cached_tokens", action="store_true"
    )
    # vLLM's --return-tokens-as-token-ids: logprob tokens as "token_id:N" on every request
    return_tokens_as_token_ids: bool = arg(
        False,
        'logprob tokens as "token_id:N" strings on every request (vLLM\'s flag)',
        action="store_true",
    )
    log_level: str = arg("info", choices=("critical", "error", "warning", "info", "debug"))
    # vLLM's --lora-modules: adapters loaded before the server accepts requests
    lora_modules: tuple[LoRAModulePath, ...] = arg(
        (),
        "LoRA adapters to load at start (needs --enable-lora), as vLLM's flag: "
        'name=path or JSON {"name": ..., "path": ..., "base_model_name": ...}',
        metavar="MODULE",
        cli_type=list[str] | None,
        parse=parse_lora_modules,
        action="extend",
    )
    # vLLM's tool calling and reasoning flags: tool_choice "auto" needs both of the first
    # two; the parsers are named as vLLM names them (parsers.TOOL_PARSERS / REASONING_PARSERS).
    enable_auto_tool_choice: bool = arg(
        False,
        'let the model choose to call tools (tool_choice "auto"; needs --tool-call-parser)',
        action="store_true",
    )
    tool_call_parser: str | None = arg(
        None,
        "how tool calls are read from the model's text: hermes (Qwen2.5/Qwen3), "
        "qwen3_coder, llama3_json, pythonic",
        metavar="NAME",
    )
    structured_outputs: StructuredOutputsConfig = arg(
        StructuredOutputsConfig(),
        "defaults for every constraint, e.g. '{\"disable_any_whitespace\": true}' "
        "(vLLM's flag, compiled by llguidance). backend: auto (vLLM's default: a JSON "
        "schema allows only the properties it lists) or guidance (JSON Schema's open "
        "objects, unless disable_additional_properties)",
        metavar="JSON",
        name="structured_outputs_config",
        cli_type=str | None,
        parse=StructuredOutputsConfig.from_json,
    )
    reasoning_parser: str | None = arg(
        None, "split the model's thinking into `reasoning`: qwen3, deepseek_r1", metavar="NAME"
    )
    max_request_body_bytes: int = arg(
        DEFAULT_MAX_REQUEST_BODY_BYTES,
        "larger request bodies are refused 413 before they are read",
    )
    # vLLM's flag: a chat template sent in a request is code the server runs.
    trust_request_chat_template: bool = arg(
        False,
        "accept a chat_template in requests (code the server runs); refused otherwise",
        action="store_true",
    )
    # Unknown request fields: ignored with a logged warning as vLLM does (False), or
    # refused with 400 naming the field (True, --reject-unknown-fields).
    reject_unknown_fields: bool = arg(
        False,
        "refuse request fields the OpenAI routes do not know (400 naming the field); "
        "by default they are ignored with a logged warning, as vLLM does",
        action="store_true",
    )


def get_engine(request: Request) -> AsyncLLM:
    return request.app.state.engine


def get_server_config(request: Request) -> ServerConfig:
    return request.app.state.server_config


def get_metrics(request: Request) -> ServerMetrics:
    return request.app.state.metrics


def get_lora_ids(request: Request) -> AdapterIds:
    return request.app.state.lora_ids
