"""--kv-cache-dtype (fp8 = fp8_e4m3, fp8_e5m2): the engine's cache, its size for a memory
budget, refused values, and an FP8-cache engine's logprobs against transformers in float32
whose attention reads keys and values quantized and dequantized as the cache stores them
(model/kv_fp8.py)."""

from __future__ import annotations

import pytest
import torch

from hotswap import LLM, SamplingParams
from hotswap.engine_args import EngineArgs
from hotswap.errors import InvalidArgument
from hotswap.model.kv_fp8 import FP8_KV_DTYPE, FP8_KV_DTYPES, dequantize_kv, quantize_kv
from tests.helpers.recording import record_logits
from tests.model.test_parity import PROMPTS


@pytest.mark.parametrize("value", ["fp8_inc", "int8", "bfloat16", "FP8", "fp8_e5m2 "])
def test_unserved_values_are_refused_naming_the_field(value: str) -> None:
    with pytest.raises(InvalidArgument, match="kv_cache_dtype") as info:
        EngineArgs(kv_cache_dtype=value).create_engine_config()
    assert info.value.field == "kv_cache_dtype"


def test_fp8_and_fp8_e4m3_are_one_cache_dtype() -> None:
    for value in ("fp8", "fp8_e4m3"):
        cache = EngineArgs(kv_cache_dtype=value).create_engine_config().cache
        assert cache.kv_cache_dtype == "fp8_e4m3"
        assert cache.cache_dtype(torch.bfloat16) == FP8_KV_DTYPE
    e5m2 = EngineArgs(kv_cache_dtype="fp8_e5m2").create_engine_config().cache
    assert e5m2.kv_cache_dtype == "fp8_e5m2"
    assert e5m2.cache_dtype(torch.bfloat16) == torch.float8_e5m2
    auto = EngineArgs().create_engine_config().cache
    assert auto.kv_cache_dtype == "auto" and auto.cache_dtype(torch.bfloat16) == torch.bfloat16


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e5m2"])
def test_an_fp8_cache_holds_twice_the_blocks_of_a_bf16_one(tiny_model_factory, kv_dtype) -> None:  # noqa: ANN001
    model_dir = tiny_model_factory("llama")
    budget = 1 << 20
    runners = {}
    for dtype in ("auto", kv_dtype):
        llm = LLM(str(model_dir), dtype="bfloat16", kv_cache_memory_bytes=budget,
                  kv_cache_dtype=dtype, enforce_eager=True, progress=False)  # fmt: skip
        runners[dtype] = llm.engine.runner
    bf16, fp8 = runners["auto"], runners[kv_dtype]
    assert fp8.kv_bytes_per_block() * 2 == bf16.kv_bytes_per_block()
    assert fp8.num_blocks == 2 * bf16.num_blocks
    assert bf16.kv_caches[0][0].dtype == torch.bfloat16
    assert fp8.kv_caches[0][0].dtype == (FP8_KV_DTYPE if kv_dtype == "fp8" else torch.float8_e5m2)
    assert fp8.kv_caches[0][0].shape[0] == fp8.num_blocks
    attn = fp8.model.model.layers[0].self_attn
    assert attn.kv_scales == (1.0, 1.0)  # no scales in the checkpoint: vLLM's default
    assert bf16.model.model.layers[0].self_attn.kv_scales is None


def fp8_kv_transformers(model_dir, scales: tuple[float, float], codes=FP8_KV_DTYPE):  # noqa: ANN001, ANN201
    """transformers' model in float32, its attention over K/V quantized to `codes` and
    dequantized."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module, query, key, value, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        key = dequantize_kv(quantize_kv(key, scales[0], codes), scales[0], key.dtype)
        value = dequantize_kv(quantize_kv(value, scales[1], codes), scales[1], value.dtype)
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register("hotswap_fp8_kv", attention)
    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="hotswap_fp8_kv"
    ).eval()


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("cpu_kernels", [True, pytest.param(False, marks=pytest.mark.slow)],
                         ids=["kernels", "torch-ops"])  # fmt: skip
def test_fp8_cache_logprobs_match_a_reference_reading_quantized_kv(
    tiny_model_factory,
    cpu_kernels: bool,  # noqa: ANN001
    kv_dtype: str,
) -> None:
    model_dir = tiny_model_factory("llama")
    llm = LLM(str(model_dir), dtype="float32", kv_cache_dtype=kv_dtype, block_size=8,
              max_num_batched_tokens=32, cpu_kernels=cpu_kernels, progress=False)  # fmt: skip
    recorder = record_logits(llm)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    from transformers import AutoModelForCausalLM

    codes = FP8_KV_DTYPES["fp8_e4m3" if kv_dtype == "fp8" else kv_dtype]
    reference = fp8_kv_transformers(model_dir, (1.0, 1.0), codes)
    plain_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    unquantized = 0.0
    for out in outs:
        ours = torch.stack(recorder.logits[out.request_id]).log_softmax(-1)
        ids = list(out.prompt_token_ids) + list(out.outputs[0].token_ids)
        start = len(out.prompt_token_ids)
        with torch.no_grad():
            logits = reference(torch.tensor([ids])).logits[0, start - 1 : len(ids) - 1]
        torch.testing.assert_close(ours, logits.log_softmax(-1), atol=1e-4, rtol=0)
        with torch.no_grad():  # the test can tell: plain float32 K/V differ by far more
            plain = plain_model(torch.tensor([ids])).logits[0]
        plain = plain[start - 1 : len(ids) - 1].log_softmax(-1)
        unquantized = max(unquantized, float((plain - ours).abs().max()))
    assert unquantized > 1e-3


@pytest.mark.slow
def test_fp8_weights_and_cache_sleep_and_wake_to_the_same_tokens(tiny_model_factory) -> None:  # noqa: ANN001
    # The cache freed by sleep comes back as FP8 codes; prefix hits read the codes again.
    model_dir = tiny_model_factory("llama")
    llm = LLM(str(model_dir), dtype="bfloat16", quantization="fp8", kv_cache_dtype="fp8",
              enable_sleep_mode=True, block_size=8, progress=False)  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    hits = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    llm.sleep(level=1)
    assert llm.engine.runner.kv_caches[0][0].numel() == 0
    llm.wake_up()
    assert llm.engine.runner.kv_caches[0][0].dtype == FP8_KV_DTYPE
    after = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert before == hits == after


@pytest.mark.slow
@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e5m2"])
def test_a_bf16_model_reads_its_fp8_cache_through_the_tiled_kernel(
    tiny_model_factory,  # noqa: ANN001
    kv_dtype: str,
) -> None:
    """Head size 64, bf16 queries: the FP8 codes are kept in tiles (written by the kernel,
    read by the tiled decode kernel, untiled for prefill chunks over cached context); the
    tokens and logprobs are those of the torch path reading the same codes, within bf16
    rounding (a greedy token may differ only where the torch path's top two are within
    bf16 rounding of a tie), and a prefix hit gives the first run's tokens."""
    model_dir = tiny_model_factory("llama", head_dim=64, num_attention_heads=4,
                                   num_key_value_heads=2, hidden_size=128)  # fmt: skip
    args = dict(dtype="bfloat16", kv_cache_dtype=kv_dtype, block_size=16, progress=False,
                max_num_batched_tokens=32)  # fmt: skip
    tiled = LLM(str(model_dir), **args)
    assert tiled.engine.runner.backend.tiled  # the FP8 cache is tiled
    torch_ops = LLM(str(model_dir), cpu_kernels=False, **args)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    ours = tiled.generate(PROMPTS, params, use_tqdm=False)
    theirs = torch_ops.generate(PROMPTS, params, use_tqdm=False)
    agree = 0
    for a, b in zip(ours, theirs, strict=True):
        x, y = a.outputs[0], b.outputs[0]
        same = next((i for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids)) if s != t),
                    len(x.token_ids))  # fmt: skip
        agree += same
        got = [p[t].logprob for p, t in zip(x.logprobs[:same], x.token_ids)]
        want = [p[t].logprob for p, t in zip(y.logprobs[:same], y.token_ids)]
        assert got == pytest.approx(want, abs=0.1)  # bf16 attention outputs, two paths
        if same < len(x.token_ids):  # a near tie: bf16 steps of the logprobs (~0.016)
            top = sorted((p.logprob for p in y.logprobs[same].values()), reverse=True)
            assert top[0] - top[1] < 0.05
    assert agree >= 0.75 * 24 * len(PROMPTS)
    again = tiled.generate(PROMPTS, params, use_tqdm=False)  # prefix hits: untiled codes
    assert sum(o.num_cached_tokens for o in again) > 0
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in ours]
