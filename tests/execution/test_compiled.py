"""Compiled decode steps (hotswap/execution/compiled.py) against transformers and against the
eager path: the same greedy tokens and logits within float32 rounding, every decode step
of up to 8 sequences through the graphs (none recompiles), weight changes seen without a
recompile, and a clean fall back when compilation is off or disabled.

The rest of the suite runs eagerly (tests/conftest.py); these tests compile, which costs
about a minute on a machine's first run (Inductor caches the graphs on disk)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from hotswap import LLM, SamplingParams
from tests.model.test_parity import PROMPTS, hf_reference, run_engine

# Compiles decode graphs for engines in this process: slow.
pytestmark = pytest.mark.slow


@pytest.fixture
def compiling():  # noqa: ANN201
    with torch._dynamo.config.patch(disable=False):
        yield


def compiled_counts(llm: LLM) -> tuple[int, int]:
    stats = llm.engine.stats.get_stats()
    assert stats["compiled_decode"]
    return stats["compiled_decode_steps"], stats["eager_decode_steps"]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral"])
def test_compiled_steps_match_transformers(compiling, tiny_model_factory, arch) -> None:  # noqa: ANN001
    model_dir = tiny_model_factory(arch)
    llm, outs, logits = run_engine(
        model_dir, PROMPTS, max_new_tokens=24, block_size=8, max_num_batched_tokens=32
    )
    compiled, eager = compiled_counts(llm)
    assert compiled >= 20 and eager == 0  # 5 prompts: every decode step had <= 8 rows
    ref_tokens, ref_logits = hf_reference(model_dir, [o.prompt_token_ids for o in outs], 24)
    for out, expected, ours, theirs in zip(outs, ref_tokens, logits, ref_logits):
        assert out.outputs[0].token_ids == expected, out.prompt
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=0)


def test_batch_sizes_and_contexts_share_two_graphs(compiling, tiny_model_factory) -> None:  # noqa: ANN001
    """1 to 8 rows, contexts from one block to many: no step needs a new graph."""
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", block_size=8, progress=False)
    eager = LLM(str(tiny_model_factory("llama")), dtype="float32", block_size=8,
                enforce_eager=True, progress=False)  # fmt: skip
    assert eager.engine.runner.compiled is None
    prompts = [[5 + i] * (3 + 17 * i) for i in range(8)]
    params = [SamplingParams(temperature=0, max_tokens=4 + 6 * i, ignore_eos=True)
              for i in range(8)]  # fmt: skip
    for n in (1, 3, 8):
        ours = llm.generate(prompts[:n], params[:n], use_tqdm=False)
        theirs = eager.generate(prompts[:n], params[:n], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in ours] == [o.outputs[0].token_ids for o in theirs]
    compiled, fallbacks = compiled_counts(llm)
    assert compiled > 40 and fallbacks == 0


def test_weight_changes_reach_the_graphs(compiling, tiny_model_factory, tmp_path) -> None:  # noqa: ANN001
    v1, v2 = tiny_model_factory("llama", 0), tiny_model_factory("llama", 1)
    prompts = [[7, 8, 9, 10], [11, 12, 13]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def tokens(llm: LLM) -> list[list[int]]:
        llm.reset_prefix_cache()
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    fresh = [tokens(LLM(str(v), dtype="float32", progress=False, enforce_eager=True))
             for v in (v1, v2)]  # fmt: skip
    llm = LLM(str(v1), dtype="float32", progress=False, enable_sleep_mode=True)
    assert tokens(llm) == fresh[0]
    llm.load_weights_from_disk(str(v2))
    assert tokens(llm) == fresh[1]
    llm.call("sleep", level=1)  # weights offloaded, KV cache freed and later re-allocated
    llm.call("wake_up")
    assert tokens(llm) == fresh[1]
    (path,) = v1.glob("*.safetensors")
    llm.load_weights_inline(load_file(path))
    assert tokens(llm) == fresh[0]
    compiled, fallbacks = compiled_counts(llm)
    assert compiled > 0 and fallbacks == 0


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_compiled_moe_steps_return_the_experts_and_logprobs_of_eager_ones(  # noqa: ANN001
    compiling, tiny_model_factory, arch: str
) -> None:
    """The routed experts' single fused call lets a mixture of experts' decode steps
    compile; the experts each step chose (routing replay) and the logprobs are the eager
    engine's."""
    model_dir = tiny_model_factory(arch)
    args = dict(dtype="float32", block_size=8, progress=False, enable_return_routed_experts=True)
    compiled = LLM(str(model_dir), **args)
    eager = LLM(str(model_dir), enforce_eager=True, **args)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    ours = compiled.generate(PROMPTS, params, use_tqdm=False)
    theirs = eager.generate(PROMPTS, params, use_tqdm=False)
    steps, fallbacks = compiled_counts(compiled)
    assert steps >= 10 and fallbacks == 0
    for a, b in zip(ours, theirs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, a.prompt
        np.testing.assert_array_equal(a.outputs[0].routed_experts, b.outputs[0].routed_experts)
        got = [next(iter(step.values())).logprob for step in a.outputs[0].logprobs]
        want = [next(iter(step.values())).logprob for step in b.outputs[0].logprobs]
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def test_falls_back_cleanly_without_compilation(tiny_model_factory, monkeypatch) -> None:  # noqa: ANN001
    """torch.compile unavailable (disabled, as in the rest of this suite), eager mode asked
    for, or a compile that fails: the engine runs eagerly and answers the same."""
    model_dir = tiny_model_factory("llama")
    args = dict(dtype="float32", progress=False)
    expected = run_engine(model_dir, PROMPTS, 12, enforce_eager=True)[1]
    disabled = LLM(str(model_dir), **args)  # TORCH_COMPILE_DISABLE from conftest
    assert disabled.engine.runner.compiled is None
    assert not disabled.engine.stats.get_stats()["compiled_decode"]
    monkeypatch.setattr("hotswap.execution.compiled.CompiledDecode._logits",
                        lambda *a: (_ for _ in ()).throw(RuntimeError("no compiler")))  # fmt: skip
    with torch._dynamo.config.patch(disable=False):
        failed = LLM(str(model_dir), **args)
    assert failed.engine.runner.compiled is None
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for llm in (disabled, failed):
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in expected]


def test_batch_invariant_mode_stays_eager(compiling, tiny_model_factory) -> None:  # noqa: ANN001
    llm = LLM(str(tiny_model_factory("llama")), dtype="float32", batch_invariant=True,
              progress=False)  # fmt: skip
    assert llm.engine.runner.compiled is None


# One engine in a process of its own (Inductor's cache directory is process-wide); with a
# third argument, it first makes the cache entry of its ranges a stale one: the ranges
# widened to that many block columns, the key left as it was.
ENGINE = """
import json, logging, sys
logging.basicConfig(level=logging.WARNING)
from hotswap import LLM, SamplingParams
from hotswap.execution import compiled
model, max_model_len, columns = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
if columns:
    key = compiled.cache_tag(compiled.MAX_BLOCK_COLUMNS)
    compiled.MAX_BLOCK_COLUMNS, compiled.cache_tag = columns, lambda max_blocks: key
llm = LLM(model, dtype="float32", max_model_len=max_model_len, progress=False)
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
llm.generate([[5, 6, 7], [8, 9]], params, use_tqdm=False)
graphs = llm.engine.runner.compiled
steps = None if graphs is None else [graphs.compiled_steps, graphs.eager_steps]
print("STEPS", json.dumps(steps))
"""


def engine_process(model: Path, max_model_len: int, cache: Path, columns: int = 0):  # noqa: ANN201
    """(compiled steps, eager steps) or None when the engine runs eagerly, and its log."""
    env = {k: v for k, v in os.environ.items() if k != "TORCH_COMPILE_DISABLE"}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    args = [sys.executable, "-c", ENGINE, str(model), str(max_model_len), str(columns)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("STEPS ")]
    return json.loads(line.removeprefix("STEPS ")), log


def test_engines_of_other_lengths_share_one_compile_cache(tiny_model_factory, tmp_path) -> None:  # noqa: ANN001
    """max_model_len 128, then 512, on one cache: both decode through the graphs (the
    second from the first's compile), and nothing logs a traceback. Before, the second
    took the first's graphs with their guard `block columns <= 8` against its own range
    (<= 32), logged a 60-line ConstraintViolationError and ran eagerly, as every later
    start did until the cache was deleted."""
    model = tiny_model_factory("llama")
    for max_model_len in (128, 512):
        steps, log = engine_process(model, max_model_len, tmp_path)
        assert steps is not None and steps[0] > 0 and steps[1] == 0, log
        assert "Traceback" not in log and "could not be compiled" not in log, log
    # An entry whose key does not say its ranges (one written before they were keyed):
    # the compile still fails, and says so in one line.
    steps, log = engine_process(model, 512, tmp_path, columns=1 << 17)
    assert steps is None, log
    (failure,) = [line for line in log.splitlines() if "could not be compiled" in line]
    assert "Constraints violated" in failure, log
    assert "Traceback" not in log and "Error while creating guard" not in log, log


def test_an_fp8_kv_cache_compiles_and_matches_the_eager_steps(
    compiling, tiny_model_factory
) -> None:  # noqa: ANN001
    # The graphs write and read e4m3 codes (the quantize and the kernel's scales inside).
    model_dir = tiny_model_factory("llama")
    args = dict(max_new_tokens=16, block_size=8, max_num_batched_tokens=32, kv_cache_dtype="fp8")
    llm, outs, logits = run_engine(model_dir, PROMPTS, **args)
    compiled, eager = compiled_counts(llm)
    assert compiled >= 10 and eager == 0
    with torch._dynamo.config.patch(disable=True):
        _, eager_outs, eager_logits = run_engine(model_dir, PROMPTS, **args)
    for out, other, ours, theirs in zip(outs, eager_outs, logits, eager_logits):
        assert out.outputs[0].token_ids == other.outputs[0].token_ids
        torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=0)
