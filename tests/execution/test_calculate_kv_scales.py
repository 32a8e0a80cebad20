"""--calculate-kv-scales (vLLM's flag): an FP8 cache's per-layer scales from the first real
step's keys and values, max|K| / 200 and max|V| / 100 (vLLM's calc_kv_scales), checked
against transformers in float32 whose attention takes the same rule over the same prompt
and then reads K/V quantized with those scales; kept through later steps and weight
rounds; accepted and without effect on an "auto" cache, as in vLLM."""

from __future__ import annotations

import pytest
import torch

from hotswap import LLM, SamplingParams
from hotswap.engine_args import EngineArgs
from hotswap.model.kv_fp8 import FP8_KV_DTYPES, dequantize_kv, quantize_kv
from tests.helpers.recording import record_logits

PROMPT = [5, 17, 3, 99, 42, 8, 61, 23, 7, 11, 30, 2]  # one request: the first step is it
LATER = [[9, 4, 77, 12], [50, 51, 52, 53, 54, 55, 56, 57, 58, 59]]


def test_the_flag_takes_effect_with_an_fp8_cache_only() -> None:
    for value, effective in (("auto", False), ("fp8", True), ("fp8_e5m2", True)):
        args = EngineArgs(kv_cache_dtype=value, calculate_kv_scales=True)
        cache = args.create_engine_config().cache
        assert cache.calculate_kv_scales and cache.scales_from_first_step == effective
    assert not EngineArgs(kv_cache_dtype="fp8").create_engine_config().cache.calculate_kv_scales


def scales_of(llm: LLM) -> list[tuple[float, float]]:
    return [
        (a.self_attn.k_scale, a.self_attn.v_scale) for a in llm.engine.runner.model.model.layers
    ]


def first_step_reference(model_dir, codes: torch.dtype):  # noqa: ANN001, ANN201
    """transformers in float32 whose attention takes each layer's scales from its K/V by
    vLLM's rule (recorded, in layer order) and then reads K/V quantized with them."""
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    recorded: list[tuple[float, float]] = []

    def attention(module, query, key, value, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if len(recorded) <= module.layer_idx:  # the prompt's pass: the first step's K/V
            recorded.append((float(key.abs().amax() / 200), float(value.abs().amax() / 100)))
        k_scale, v_scale = recorded[module.layer_idx]
        key = dequantize_kv(quantize_kv(key, k_scale, codes), k_scale, key.dtype)
        value = dequantize_kv(quantize_kv(value, v_scale, codes), v_scale, value.dtype)
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register("hotswap_first_step_scales", attention)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="hotswap_first_step_scales"
    ).eval()
    return model, recorded


@pytest.mark.parametrize("kv_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_first_step_scales_follow_vllms_rule_and_stay(tiny_model_factory, kv_dtype) -> None:  # noqa: ANN001
    model_dir = tiny_model_factory("llama")
    llm = LLM(str(model_dir), dtype="float32", kv_cache_dtype=kv_dtype, calculate_kv_scales=True,
              block_size=8, enforce_eager=True, enable_sleep_mode=True, progress=False)  # fmt: skip
    assert scales_of(llm) == [(1.0, 1.0)] * 2  # not known before the first step
    recorder = record_logits(llm)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    ours = scales_of(llm)
    reference, recorded = first_step_reference(model_dir, FP8_KV_DTYPES[kv_dtype])
    ids = PROMPT + list(out.outputs[0].token_ids)
    with torch.no_grad():
        reference(torch.tensor([PROMPT]))  # the first step: the prompt alone sets the scales
        logits = reference(torch.tensor([ids])).logits[0, len(PROMPT) - 1 : len(ids) - 1]
    assert sum(ours, ()) == pytest.approx(sum(recorded, ()), rel=1e-5)
    assert all(k != 1.0 and v != 1.0 for k, v in ours)
    # codes written with the first step's scales from the first token on (the decode steps
    # read the prompt's codes back with them)
    got = torch.stack(recorder.logits[out.request_id]).log_softmax(-1)
    torch.testing.assert_close(got, logits.log_softmax(-1), atol=1e-4, rtol=0)
    for attn in (layer.self_attn for layer in llm.engine.runner.model.model.layers):
        assert attn.kv_scales == (attn.k_scale, attn.v_scale) and not attn.calculate_kv_scales
    llm.generate(LATER, params, use_tqdm=False)  # later steps: other K/V, the same scales
    llm.load_weights_from_disk(str(tiny_model_factory("llama", 1)))  # a weight round
    llm.sleep(level=1)
    llm.wake_up()
    llm.generate(LATER, params, use_tqdm=False)
    assert scales_of(llm) == ours  # bitwise: kept for the engine's life
    again = LLM(str(model_dir), dtype="float32", kv_cache_dtype=kv_dtype,
                calculate_kv_scales=True, block_size=8, enforce_eager=True,
                progress=False)  # fmt: skip
    again.generate([PROMPT], params, use_tqdm=False)
    assert scales_of(again) == ours  # the same first step, the same scales


def test_an_auto_cache_takes_the_flag_and_nothing_changes(tiny_model_factory) -> None:  # noqa: ANN001
    model_dir = str(tiny_model_factory("llama"))
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    tokens = []
    for flag in (True, False):
        llm = LLM(model_dir, dtype="float32", calculate_kv_scales=flag, enforce_eager=True,
                  progress=False)  # fmt: skip
        tokens.append([o.outputs[0].token_ids for o in llm.generate([PROMPT] + LATER, params,
                                                                     use_tqdm=False)])  # fmt: skip
        attn = llm.engine.runner.model.model.layers[0].self_attn
        assert attn.kv_scales is None and (attn.k_scale, attn.v_scale) == (1.0, 1.0)
    assert tokens[0] == tokens[1]


@pytest.mark.slow
def test_decode_steps_are_not_compiled_while_scales_are_pending(tiny_model_factory) -> None:  # noqa: ANN001
    # The graphs would keep the scales they were traced with (1.0): eager decode instead.
    with torch._dynamo.config.patch(disable=False):
        llm = LLM(str(tiny_model_factory("llama")), dtype="float32", kv_cache_dtype="fp8",
                  calculate_kv_scales=True, progress=False)  # fmt: skip
    assert llm.engine.runner.compiled is None
