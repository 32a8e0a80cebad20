"""`hotswap` command line: `hotswap generate [--model M] PROMPT...`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hotswap.config import DEFAULT_KV_CACHE_BYTES


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
        "--batch-invariant",
        action="store_true",
        help="bitwise-identical logits whatever the batch (slower)",
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
    return parser


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
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"hotswap: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
