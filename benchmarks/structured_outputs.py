"""Structured outputs under load: a batch of chat requests in which half carry a JSON
schema, against the same batch with none (hotswap's cost of grammar masks), and the same
schema batch on vLLM's CPU build (its llguidance backend, "guidance").

Each measurement runs in its own subprocess and environment (`--worker`); the engines
alternate and each keeps its best of `--repeats`. Requests sample (temperature 0.7,
seeded) at most `--max-tokens` tokens; a constrained request ends when its JSON is complete
(EOS is the only token allowed then), a free one may run to the limit, so the measure is
generated tokens per second; the schema outputs are checked to parse.

    python benchmarks/structured_outputs.py [--num-requests 64] [--repeats 2] [--no-vllm]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 20},
        "languages": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "languages"],
    "additionalProperties": False,
}
MODES = ("plain", "half-schema")


def conversations(count: int) -> list[list[dict]]:
    people = ["a pilot", "a chef", "a poet", "a nurse", "a farmer", "a judge", "a coder", "a diver"]
    return [
        [{"role": "user", "content": f"Describe {people[i % len(people)]} (#{i}) as a JSON "
          "object with name, age, city and languages."}]
        for i in range(count)
    ]  # fmt: skip


def constrained(mode: str, index: int) -> bool:
    return mode == "half-schema" and index % 2 == 0


def hotswap_run(args: argparse.Namespace, mode: str) -> tuple[int, float, list[str]]:
    from hotswap import LLM, SamplingParams
    from hotswap.sampling_params import StructuredOutputsParams

    llm = LLM(args.model_dir, progress=False)
    return timed_chat(llm, SamplingParams, StructuredOutputsParams, args, mode)


def vllm_run(args: argparse.Namespace, mode: str) -> tuple[int, float, list[str]]:
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    llm = LLM(model=args.model_dir, max_model_len=2048, seed=0)
    return timed_chat(llm, SamplingParams, StructuredOutputsParams, args, mode)


def timed_chat(llm, params_cls, schema_cls, args: argparse.Namespace, mode: str):  # noqa: ANN001, ANN201
    """The batch through either engine's `LLM.chat` (same API): (generated tokens,
    seconds, the constrained outputs' texts)."""
    chats = conversations(args.num_requests)

    def params(i: int):  # noqa: ANN202
        schema = schema_cls(json=SCHEMA) if constrained(mode, i) else None
        return params_cls(temperature=0.7, seed=i, max_tokens=args.max_tokens,
                          structured_outputs=schema)  # fmt: skip

    llm.chat(chats[:4], [params(i) for i in range(4)], use_tqdm=False)  # warm-up
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.chat(chats, [params(i) for i in range(len(chats))], use_tqdm=False)
    seconds = time.perf_counter() - start
    texts = [o.outputs[0].text for i, o in enumerate(outs) if constrained(mode, i)]
    return sum(len(o.outputs[0].token_ids) for o in outs), seconds, texts


def worker(args: argparse.Namespace) -> None:
    run = hotswap_run if args.worker == "hotswap" else vllm_run
    tokens, seconds, texts = run(args, args.mode)
    complete = 0
    for text in texts:
        try:
            value = json.loads(text)
        except ValueError:
            continue  # cut by max_tokens: a prefix of a valid object
        assert set(value) == set(SCHEMA["required"]), text
        complete += 1
    print("RESULT " + json.dumps({"tokens": tokens, "seconds": seconds,
                                  "parsed": complete, "constrained": len(texts)}))  # fmt: skip


def measure(engine: str, mode: str, args: argparse.Namespace) -> dict:
    python = sys.executable if engine == "hotswap" else str(Path(args.vllm_venv) / "bin/python")
    cmd = [python, str(HERE), "--worker", engine, "--mode", mode, "--model-dir",
           args.model_dir, "--num-requests", str(args.num_requests),
           "--max-tokens", str(args.max_tokens)]  # fmt: skip
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4", TOKENIZERS_PARALLELISM="false")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{engine} {mode} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    result = json.loads(lines[-1].removeprefix("RESULT "))
    result["tok_s"] = result["tokens"] / result["seconds"]
    return result


def main(args: argparse.Namespace) -> None:
    if args.model_dir is None:
        from hotswap.default_model import default_model_dir

        args.model_dir = str(default_model_dir())
    runs = [("hotswap", "plain"), ("hotswap", "half-schema")]
    if not args.no_vllm:
        runs += [("vllm", "plain"), ("vllm", "half-schema")]
    best: dict[tuple[str, str], dict] = {}
    for repeat in range(args.repeats):
        for engine, mode in runs if repeat % 2 == 0 else runs[::-1]:
            result = measure(engine, mode, args)
            parsed = f"{result['parsed']}/{result['constrained']} JSON parsed"
            print(f"{engine:8s} {mode:12s} {result['tok_s']:7.1f} tok/s "
                  f"({result['tokens']} tokens, {result['seconds']:.1f} s, {parsed})",
                  flush=True)  # fmt: skip
            if (engine, mode) not in best or result["tok_s"] > best[engine, mode]["tok_s"]:
                best[engine, mode] = result
    report(best)


def report(best: dict[tuple[str, str], dict]) -> None:
    print("\n| engine | plain tok/s | half with a JSON schema tok/s | ratio |")
    print("|---|---|---|---|")
    for engine in ("hotswap", "vllm"):
        if (engine, "plain") in best:
            plain, schema = best[engine, "plain"]["tok_s"], best[engine, "half-schema"]["tok_s"]
            print(f"| {engine} | {plain:.1f} | {schema:.1f} | {schema / plain:.2f} |")
    if ("vllm", "half-schema") in best:
        ratio = best["hotswap", "half-schema"]["tok_s"] / best["vllm", "half-schema"]["tok_s"]
        print(f"\nhalf-schema batch, hotswap vs vLLM: {ratio:.2f}x")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--model-dir", default=None, help="default: the built-in model")
    parser.add_argument("--vllm-venv", default=str(HERE.parent.parent.parent / ".venv-vllm"))
    parser.add_argument("--no-vllm", action="store_true", help="hotswap only")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--worker", choices=["hotswap", "vllm"], help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.worker:
        worker(arguments)
    else:
        main(arguments)
