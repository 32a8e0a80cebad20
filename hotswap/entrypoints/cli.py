"""`hotswap` command line: `hotswap serve [MODEL]` and `hotswap generate [--model M] PROMPT...`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hotswap.config import DEFAULT_KV_CACHE_BYTES
from hotswap.entrypoints.agentic_args import (
    add_agentic_args,
    add_generation_config_args,
    check_parsers,
)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags, spelled as vLLM spells them."""
    group = parser.add_argument_group("engine")
    group.add_argument(
        "--model",
        default=None,
        help="Hugging Face-format model directory (default: built-in SmolLM2-135M-Instruct)",
    )
    group.add_argument(
        "--tokenizer", default=None, help="tokenizer directory (default: the model's)"
    )
    group.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bfloat16", "float32"],
        help="auto = bfloat16 (fastest on AMX CPUs)",
    )
    group.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    group.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    group.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="engine cores behind one server (requests balanced, control calls fanned out)",
    )
    group.add_argument(
        "--data-parallel-backend",
        default="mp",
        choices=["mp", "ray"],
        help="where the engine cores run: mp, child processes; ray, Ray actors (one "
        "placement-group bundle each; pip install 'hotswap[ray]')",
    )
    group.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDRESS",
        help="Ray cluster for --data-parallel-backend ray ('auto', 'ray://host:10001'; "
        "default: ray.init()'s, a new local one if none is running)",
    )
    group.add_argument(
        "--num-threads", type=int, default=None, help="torch threads per engine core"
    )
    group.add_argument("--seed", type=int, default=0)
    group.add_argument("--max-model-len", type=int, default=None)
    group.add_argument("--block-size", type=int, default=16)
    group.add_argument(
        "--num-kv-blocks",
        type=int,
        default=None,
        help="KV cache size in blocks (overrides --kv-cache-memory)",
    )
    group.add_argument(
        "--kv-cache-memory",
        "--kv-cache-memory-bytes",  # vLLM's spelling
        type=int,
        default=DEFAULT_KV_CACHE_BYTES,
        dest="kv_cache_memory_bytes",
        help="KV cache budget in bytes",
    )
    group.add_argument(
        "--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True
    )
    group.add_argument(
        "--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True
    )
    group.add_argument("--max-num-seqs", type=int, default=128)
    group.add_argument("--max-num-batched-tokens", type=int, default=None)
    group.add_argument(
        "--max-prefill-tokens-while-decoding",
        type=int,
        default=None,
        help="cap on prefill tokens in a step while requests decode (bounds step time)",
    )
    group.add_argument(
        "--batch-invariant",
        action="store_true",
        help="bitwise-identical logits whatever the batch (slower)",
    )
    group.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run the model eagerly, never through torch.compile (vLLM's flag)",
    )
    group.add_argument(
        "--cpu-kernels",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="hotswap's CPU kernels (paged decode attention, bf16 GEMV; built once per "
        "machine); --no-cpu-kernels runs on torch operators only",
    )
    group.add_argument(
        "--prepack-weights",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="with the CPU kernels, keep a oneDNN-packed copy of the bf16 linear weights "
        "for larger batches (faster GEMMs; one more copy of them in memory)",
    )
    group.add_argument(
        "--weight-transfer-config",
        default=None,
        metavar="JSON",
        help='weight transfer backend, e.g. \'{"backend": "gloo"}\' (gloo, nccl, ipc, disk)',
    )
    add_generation_config_args(group)
    group.add_argument(
        "--logprobs-mode",
        default="raw_logprobs",
        choices=["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"],
        help="what logprobs report; processed_logprobs: the distribution tokens are drawn "
        "from (after penalties, temperature, top-k/top-p/min-p), as RL trainers need",
    )
    group.add_argument(
        "--lm-head-dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="dtype of the final norm and LM head (default: --dtype); float32 with a "
        "bf16 body brings logprobs close to an fp32 trainer's",
    )
    group.add_argument(
        "--allowed-weight-dirs",
        nargs="+",
        default=None,
        metavar="DIR",
        help="directories disk reloads (/update_weights_from_disk, the disk backend) may "
        "read from, symlinks resolved (default: the model directory's parent)",
    )
    group.add_argument(
        "--enable-sleep-mode",
        action="store_true",
        help="allow /sleep: offload or drop weights and free the KV cache",
    )
    group.add_argument(
        "--worker-extension-cls",
        default=None,
        metavar="MODULE:CLASS",
        help="a class whose public methods /collective_rpc may call inside the engine "
        "(vLLM's flag; 'module.Class' also accepted)",
    )


def engine_kwargs(args: argparse.Namespace) -> dict:
    from hotswap.config import EngineArgs

    names = EngineArgs.field_names() - {"model"}
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


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
    add_agentic_args(group)
    add_limit_args(group)


def add_limit_args(group: argparse._ArgumentGroup) -> None:
    from hotswap.entrypoints.limits import DEFAULT_MAX_REQUEST_BODY_BYTES

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
    from hotswap.entrypoints.api_server import run_server
    from hotswap.entrypoints.state import ServerConfig
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
    )
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
