"""`hotswap generate` as a real subprocess, checked against the in-process LLM."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hotswap import LLM, SamplingParams
from hotswap.entrypoints.cli import build_parser

# Small KV cache for the runs that do not test the defaults (the default is 1 GiB).
SMALL_KV = ["--num-kv-blocks", "16", "--max-model-len", "256"]


def hotswap(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    return subprocess.run(
        [sys.executable, "-m", "hotswap", *args],
        capture_output=True,
        text=True,
        encoding="utf-8",
        env=env,
        timeout=120,
        check=False,
    )


def expected_stdout(prompts: list[str], outputs: list, chat: bool) -> str:
    """What run_generate prints: a header per choice, then the (prompt +) completion."""
    lines = []
    for prompt, output in zip(prompts, outputs):
        for choice in output.outputs:
            lines.append(f"--- {prompt!r} [{choice.finish_reason}, {len(choice.token_ids)} tokens]")
            lines.append(choice.text if chat else prompt + choice.text)
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> LLM:
    return LLM(
        str(tiny_llama), dtype="float32", num_kv_blocks=16, max_model_len=256, progress=False
    )


@pytest.mark.slow
def test_generate_prints_every_prompt_and_its_completion(tiny_llama: Path, reference: LLM) -> None:
    result = hotswap(
        "generate", "--model", str(tiny_llama), "--dtype", "float32", "--max-tokens", "5",
        "hello", "world",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "--- 'hello' [" in result.stdout and "--- 'world' [" in result.stdout
    params = SamplingParams(temperature=0.0, max_tokens=5)
    outputs = reference.generate(["hello", "world"], params, use_tqdm=False)
    assert result.stdout == expected_stdout(["hello", "world"], outputs, chat=False)
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_chat_applies_the_chat_template(tiny_llama: Path, reference: LLM) -> None:
    prompts = ["hello", "Pause, swap the weights"]
    result = hotswap(
        "generate", "--model", str(tiny_llama), "--dtype", "float32", "--max-tokens", "6",
        *SMALL_KV, "--chat", *prompts,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    params = SamplingParams(temperature=0.0, max_tokens=6)
    conversations = [[{"role": "user", "content": p}] for p in prompts]
    outputs = reference.chat(conversations, params, use_tqdm=False)
    assert outputs[0].prompt_token_ids[0] == reference.tokenizer.bos_token_id  # <|im_start|>
    assert result.stdout == expected_stdout(prompts, outputs, chat=True)


@pytest.mark.parametrize(
    ("flags", "field"),
    [
        (["--max-tokens", "0"], "max_tokens"),
        (["--temperature", "-1"], "temperature"),
        (["--block-size", "0"], "block_size"),
        (["--kv-cache-memory-bytes", "0"], "kv_cache_memory_bytes"),  # vLLM's spelling
        (["--model", "/nonexistent/tiny-model"], "model"),
    ],
)
def test_bad_flag_value_exits_nonzero_without_traceback(
    tiny_llama: Path, flags: list[str], field: str
) -> None:
    result = hotswap("generate", "--model", str(tiny_llama), *SMALL_KV, *flags, "hello")
    assert result.returncode != 0
    assert result.stdout == ""
    assert f"hotswap: error: {field}: " in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_vllm_kv_cache_memory_bytes_flag_sets_the_budget() -> None:
    """`vllm serve ... --kv-cache-memory-bytes N` (vLLM's flag) means what
    hotswap's `--kv-cache-memory N` does."""
    for flag in ("--kv-cache-memory-bytes", "--kv-cache-memory"):
        args = build_parser().parse_args(["serve", "some/model", flag, str(3 << 30)])
        assert args.kv_cache_memory_bytes == 3 << 30


def test_lora_modules_take_vllm_forms() -> None:
    """`--lora-modules name=path` or JSON (vLLM's forms), several per flag or flag."""
    from hotswap.lora.modules import LoRAModulePath, parse_lora_modules

    json_form = '{"name": "sql", "path": "/a/sql", "base_model_name": "base"}'
    argv = ["serve", "m", "--lora-modules", "tone=/a/tone", json_form, "--lora-modules", "x=/y=z"]
    values = build_parser().parse_args(argv).lora_modules
    assert parse_lora_modules(values) == (
        LoRAModulePath("tone", "/a/tone"),
        LoRAModulePath("sql", "/a/sql", "base"),
        LoRAModulePath("x", "/y=z"),
    )
    assert parse_lora_modules(None) == ()
    for bad, message in [
        ("just-a-path", "invalid format"),
        ("=/a/b", "'name' must be a non-empty string"),
        ('{"name": "a"}', "'path' must be a non-empty string"),
        ('{"name": "a", "path": "/p", "scale": 2}', "unknown field 'scale'"),
        ('["a", "/p"]', "is not a JSON object"),
    ]:
        with pytest.raises(ValueError, match="--lora-modules: ") as info:
            parse_lora_modules([bad])
        assert message in str(info.value)
    with pytest.raises(ValueError, match="'a' is given twice"):
        parse_lora_modules(["a=/p", "a=/q"])


def test_lora_modules_need_enable_lora(capsys: pytest.CaptureFixture[str]) -> None:
    from hotswap.entrypoints.cli import main

    assert main(["serve", "some/model", "--lora-modules", "a=/p"]) == 2
    assert "hotswap: error: --lora-modules: LoRA is not enabled: add --enable-lora" in (
        capsys.readouterr().err
    )
