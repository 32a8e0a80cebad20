"""`hotswap` command line: `hotswap serve [MODEL]` and `hotswap generate [--model M] PROMPT...`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hotswap.entrypoints.agentic_args import add_agentic_args, check_parsers
from hotswap.entrypoints.engine_flags import add_engine_args, engine_kwargs


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hotswap", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate completions for prompts")
    add_engine_args(gen)
    gen.add_argument("prompts", nargs="+", metavar="PROMPT")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--n", type=int, default=1)
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user chat message")
    add_serve_parser(sub)
    return parser


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible server with the RL control plane")
    serve.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL", help="same as --model"
    )
    add_engine_args(serve)
    group = serve.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1")
    group.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    group.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` (or set $HOTSWAP_API_KEY / $VLLM_API_KEY, "
        "or --api-key-file: a command line is visible to every local user)",
    )
    group.add_argument(
        "--api-key-file", default=None, metavar="PATH", help="read the API key from a file"
    )
    group.add_argument("--served-model-name", default=None)
    group.add_argument(
        "--enable-control",
        action="store_true",
        help="RL control plane (pause/resume, weights, sleep); also HOTSWAP_SERVER_DEV_MODE=1",
    )
    group.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens",
    )
    group.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help='logprob tokens as "token_id:N" strings on every request (vLLM\'s flag)',
    )
    group.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    group.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        default=None,
        metavar="MODULE",
        help="LoRA adapters to load at start (needs --enable-lora), as vLLM's flag: "
        'name=path or JSON {"name": ..., "path": ..., "base_model_name": ...}',
    )
    add_agentic_args(group)
    add_limit_args(group)


def add_limit_args(group: argparse._ArgumentGroup) -> None:
    from hotswap.entrypoints.server.limits import DEFAULT_MAX_REQUEST_BODY_BYTES

    group.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="larger request bodies are refused 413 before they are read",
    )
    group.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a chat_template in requests (code the server runs); refused otherwise",
    )
    group.add_argument(
        "--reject-unknown-fields",
        action="store_true",
        help="refuse request fields the OpenAI routes do not know (400 naming the field); "
        "by default they are ignored with a logged warning, as vLLM does",
    )
    group.add_argument(
        "--allowed-master-addresses",
        nargs="+",
        default=None,
        metavar="ADDR",
        help="master addresses (names, addresses or networks) a weight-transfer init may "
        "name; default any (same as allowed_master_addresses in --weight-transfer-config)",
    )


def run_serve(args: argparse.Namespace) -> None:
    import os

    from hotswap.default_model import DEFAULT_MODEL_NAME
    from hotswap.entrypoints.server.app import run_server
    from hotswap.entrypoints.server.state import ServerConfig
    from hotswap.lora.modules import parse_lora_modules
    from hotswap.structured_output import StructuredOutputsConfig

    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"model: given twice ({args.model_tag!r} and --model {args.model!r})")
    model = args.model_tag or args.model
    # vLLM's compatibility switch for its dev-mode routes.
    dev_mode = os.environ.get("HOTSWAP_SERVER_DEV_MODE", "0") not in ("", "0", "false")
    config = ServerConfig(
        served_model_name=args.served_model_name or model or DEFAULT_MODEL_NAME,
        host=args.host,
        port=args.port,
        api_key=api_key(args),
        enable_control=args.enable_control or dev_mode,
        enable_prompt_tokens_details=args.enable_prompt_tokens_details,
        log_level=args.log_level,
        return_tokens_as_token_ids=args.return_tokens_as_token_ids,
        max_request_body_bytes=args.max_request_body_bytes,
        trust_request_chat_template=args.trust_request_chat_template,
        reject_unknown_fields=args.reject_unknown_fields,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        structured_outputs=StructuredOutputsConfig.from_json(args.structured_outputs_config),
        lora_modules=parse_lora_modules(args.lora_modules),
    )
    if config.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules: LoRA is not enabled: add --enable-lora")
    check_parsers(config)
    if args.max_request_body_bytes < 1:
        raise ValueError("--max-request-body-bytes: must be at least 1")
    kwargs = engine_kwargs(args)
    if args.allowed_master_addresses:
        kwargs["weight_transfer_config"] = with_allowed_masters(
            kwargs.get("weight_transfer_config"), args.allowed_master_addresses
        )
    run_server(config, model, kwargs)


def api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else --api-key-file, else $HOTSWAP_API_KEY, else $VLLM_API_KEY."""
    import os
    from pathlib import Path

    if args.api_key and args.api_key_file:
        raise ValueError("--api-key and --api-key-file: give one of them")
    if args.api_key_file:
        try:
            key = Path(args.api_key_file).read_text().strip()
        except OSError as e:
            raise ValueError(f"--api-key-file: cannot read {args.api_key_file} ({e})") from None
        if not key:
            raise ValueError(f"--api-key-file: {args.api_key_file} is empty")
        return key
    return args.api_key or os.environ.get("HOTSWAP_API_KEY") or os.environ.get("VLLM_API_KEY")


def with_allowed_masters(config: str | None, addresses: list[str]) -> str:
    """--weight-transfer-config JSON with `allowed_master_addresses` set."""
    import json

    from hotswap.weight_transfer.config import parse_config_object

    if config is None:
        raise ValueError("--allowed-master-addresses: needs --weight-transfer-config")
    return json.dumps({**parse_config_object(config), "allowed_master_addresses": addresses})


def run_generate(args: argparse.Namespace) -> None:
    from hotswap import LLM, SamplingParams

    params = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=None if args.temperature == 0 else args.seed,
    )
    llm = LLM(args.model, **engine_kwargs(args))
    if args.chat:
        conversations = [[{"role": "user", "content": p}] for p in args.prompts]
        outputs = llm.chat(conversations, params)
    else:
        outputs = llm.generate(args.prompts, params)
    for prompt, output in zip(args.prompts, outputs):
        for choice in output.outputs:
            print(f"--- {prompt!r} [{choice.finish_reason}, {len(choice.token_ids)} tokens]")
            print(choice.text if args.chat else prompt + choice.text)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            run_generate(args)
        elif args.command == "serve":
            run_serve(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"hotswap: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
