"""`hotswap` command line: `hotswap serve [MODEL]`, `hotswap route URL...` and
`hotswap generate [--model M] PROMPT...`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from hotswap.entrypoints.agentic_args import check_parsers
from hotswap.entrypoints.engine_flags import add_engine_args, engine_kwargs
from hotswap.entrypoints.flags import add_flags, flag_values
from hotswap.entrypoints.server.state import ServerConfig
from hotswap.flag_spec import arg


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
    add_route_parser(sub)
    return parser


def add_route_parser(sub: argparse._SubParsersAction) -> None:
    from hotswap.entrypoints.router.pool import RouterConfig

    route = sub.add_parser(
        "route", help="one OpenAI-compatible front end over several `hotswap serve` instances"
    )
    route.add_argument("urls", nargs="+", metavar="URL", help="the upstream servers' base URLs")
    add_flags(route.add_argument_group("router"), RouterConfig)


def run_route(args: argparse.Namespace) -> None:
    from hotswap.entrypoints.router.app import run_router
    from hotswap.entrypoints.router.pool import RouterConfig

    for url in args.urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"URL: {url!r} is not an http:// or https:// URL")
    run_router(args.urls, RouterConfig(**flag_values(RouterConfig, args)))


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="OpenAI-compatible server with the RL control plane")
    serve.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL", help="same as --model"
    )
    add_engine_args(serve)
    group = serve.add_argument_group("server")
    add_flags(group, ServerConfig)
    add_flags(group, StartupFlags)


@dataclass(frozen=True)
class StartupFlags:
    """The server flags read once at start-up into something other than a `ServerConfig`
    field: the API key's file (into its api_key) and the master addresses (into the
    engine's --weight-transfer-config). Listed after the config's flags."""

    api_key_file: str | None = arg(None, "read the API key from a file", metavar="PATH")
    allowed_master_addresses: list[str] | None = arg(
        None,
        "master addresses (names, addresses or networks) a weight-transfer init may "
        "name; default any (same as allowed_master_addresses in --weight-transfer-config)",
        metavar="ADDR",
    )


def run_serve(args: argparse.Namespace) -> None:
    from hotswap.entrypoints.server.app import run_server

    if args.model_tag and args.model and args.model_tag != args.model:
        raise ValueError(f"model: given twice ({args.model_tag!r} and --model {args.model!r})")
    model = args.model_tag or args.model
    config = server_config(args, model)
    if config.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules: LoRA is not enabled: add --enable-lora")
    check_parsers(config)
    if config.max_request_body_bytes < 1:
        raise ValueError("--max-request-body-bytes: must be at least 1")
    kwargs = engine_kwargs(args)
    if args.allowed_master_addresses:
        kwargs["weight_transfer_config"] = with_allowed_masters(
            kwargs.get("weight_transfer_config"), args.allowed_master_addresses
        )
    run_server(config, model, kwargs)


def server_config(args: argparse.Namespace, model: str | None) -> ServerConfig:
    """The `ServerConfig` a parsed `hotswap serve` command line gives: every field from its
    flag (flags.flag_values), but for the three a flag alone does not give, resolved here
    first (so --api-key's refusals come before any other flag's, as they always did)."""
    import os

    from hotswap.default_model import DEFAULT_MODEL_NAME

    # vLLM's compatibility switch for its dev-mode routes.
    dev_mode = os.environ.get("HOTSWAP_SERVER_DEV_MODE", "0") not in ("", "0", "false")
    resolved = {
        "served_model_name": args.served_model_name or model or DEFAULT_MODEL_NAME,
        "api_key": api_key(args),
        "enable_control": args.enable_control or dev_mode,
    }
    return ServerConfig(**{**flag_values(ServerConfig, args), **resolved})


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
        elif args.command == "route":
            run_route(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"hotswap: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
