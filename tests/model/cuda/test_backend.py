"""The Triton attention backend inside a whole engine (on the CPU under Triton's
interpreter): the tokens and logprobs of the torch engine through prefill, chunked prefill,
prefix-cache hits and decode; bitwise batch invariance in batch-invariant mode (a token's
logits alone equal its logits in a mixed, chunked batch with prefix hits); and the
--attention-backend choice checked against the device."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hotswap import LLM, SamplingParams
from hotswap.engine_args import EngineArgs
from hotswap.errors import InvalidArgument
from hotswap.execution.kernel_choice import _backend_name, choose_kernels
from tests.helpers.recording import record_logits
from tests.model.cuda.conftest import DEVICE

SHARED = "Reinforcement learning trains a policy while it keeps generating rollouts. "
PROMPTS = [SHARED + "The quick", SHARED + "Paged attention", "x", SHARED * 2 + "Numbers"]
# Blocks smaller than the tiny model's layers, so that their grids have several blocks
FP8_WEIGHTS = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}}
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)


def engine(path, backend: str, **kwargs) -> LLM:  # noqa: ANN001, ANN003
    kwargs.setdefault("dtype", "float32")
    return LLM(str(path), attention_backend=backend, device=DEVICE, progress=False,
               block_size=8, **kwargs)  # fmt: skip


def outputs(llm: LLM, prompts: list[str]) -> list:
    return [o.outputs[0] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_moe"])
def test_the_triton_engine_generates_what_the_torch_engine_does(tiny_model_factory, arch) -> None:  # noqa: ANN001
    """Chunked prefill (a budget of 24 tokens), then the same prompts again from the prefix
    cache, on both backends; a mixture of experts through the fused experts, its routed
    experts returned."""
    path = tiny_model_factory(arch)
    runs = {}
    for backend in ("TORCH_SDPA", "TRITON_ATTN"):
        llm = engine(path, backend, max_num_batched_tokens=24,
                     enable_return_routed_experts=arch.endswith("moe"))  # fmt: skip
        runs[backend] = outputs(llm, PROMPTS) + outputs(llm, PROMPTS)
        llm.shutdown()
    for want, got in zip(runs["TORCH_SDPA"], runs["TRITON_ATTN"], strict=True):
        assert got.token_ids == want.token_ids
        if arch.endswith("moe"):
            assert (got.routed_experts == want.routed_experts).all()
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert a.keys() == b.keys()
            assert max(abs(a[t].logprob - b[t].logprob) for t in a) < 1e-5


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_images_through_the_triton_engine(tmp_path, family: str) -> None:  # noqa: ANN001
    """A vision-language model on the Triton backend (the CUDA path's step inputs): chunked
    prefill through images of two sizes, then the same prompts from the prefix cache, give
    the torch engine's tokens and logprobs."""
    import numpy as np
    from PIL import Image

    from tests.helpers.tiny_vl import IMAGE, write_tiny_vl_model

    path = write_tiny_vl_model(tmp_path / family, family=family)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 255, size, dtype=np.uint8))
              for size in ((90, 120, 3), (150, 60, 3))]  # fmt: skip
    prompts = [{"prompt": f"<|im_start|>user\n{text} {IMAGE} now<|im_end|>\n<|im_start|>"
                "assistant\n", "multi_modal_data": {"image": image}}
               for text, image in zip(("The quick", "Paged"), images)]  # fmt: skip
    runs = {}
    for backend in ("TORCH_SDPA", "TRITON_ATTN"):
        llm = engine(path, backend, max_num_batched_tokens=24)
        runs[backend] = outputs(llm, prompts) + outputs(llm, prompts)
        llm.shutdown()
    for want, got in zip(runs["TORCH_SDPA"], runs["TRITON_ATTN"], strict=True):
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert max(abs(a[t].logprob - b[t].logprob) for t in a.keys() & b.keys()) < 1e-5


@pytest.mark.slow
def test_batch_invariant_triton_logits_alone_equal_those_in_a_mixed_batch(tiny_llama) -> None:  # noqa: ANN001
    """Every row through the prefill kernel: decoded or prefilled, alone or batched, a
    token's logits are bitwise the same."""
    target = SHARED * 2 + "The quick brown fox"
    alone_llm = engine(tiny_llama, "TRITON_ATTN", batch_invariant=True)
    alone = record_logits(alone_llm)
    [out] = alone_llm.generate([target], GREEDY, use_tqdm=False)
    alone_logits = torch.stack(alone.logits[out.request_id])
    mixed_llm = engine(tiny_llama, "TRITON_ATTN", batch_invariant=True, max_num_batched_tokens=40)
    mixed_llm.generate([SHARED * 2 + "warm the prefix cache"], SamplingParams(max_tokens=1),
                       use_tqdm=False)  # fmt: skip
    mixed = record_logits(mixed_llm)
    others = [SHARED[: 9 * i + 3] + str(i) for i in range(4)]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=3 + i) for i in range(4)]
    outs = mixed_llm.generate(others[:2] + [target] + others[2:],
                              params[:2] + [GREEDY] + params[2:], use_tqdm=False)  # fmt: skip
    assert outs[2].num_cached_tokens > 0
    assert outs[2].outputs[0].token_ids == out.outputs[0].token_ids
    assert torch.equal(torch.stack(mixed.logits[outs[2].request_id]), alone_logits)


def config(tiny_llama, **kwargs):  # noqa: ANN001, ANN003, ANN201
    return EngineArgs(model=str(tiny_llama), **kwargs).create_engine_config()


def test_the_backend_flag_takes_vllms_names_and_refuses_others(tiny_llama) -> None:  # noqa: ANN001
    assert config(tiny_llama, attention_backend="triton_attn").attention_backend == "TRITON_ATTN"
    with pytest.raises(InvalidArgument, match="attention_backend: must be one of") as error:
        config(tiny_llama, attention_backend="FLASH_ATTN")
    assert error.value.field == "attention_backend"


def test_each_backend_is_checked_against_the_device(tiny_llama, monkeypatch) -> None:  # noqa: ANN001
    cpu = torch.device("cpu")
    chosen = choose_kernels(config(tiny_llama, attention_backend="TRITON_ATTN"), cpu, False)
    assert chosen.name == "TRITON_ATTN" and chosen.layer_kernels.head_rms_norm is not None
    invariant = config(tiny_llama, batch_invariant=True)
    assert choose_kernels(invariant, cpu, False).name == "TORCH_SDPA"  # the CPU default
    with pytest.raises(InvalidArgument, match="CPU_ATTN runs on the CPU"):
        choose_kernels(dataclasses.replace(invariant, attention_backend="CPU_ATTN"), cpu, False)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(InvalidArgument, match="TRITON_ATTN: on the host the Triton kernels"):
        choose_kernels(config(tiny_llama, attention_backend="TRITON_ATTN"), cpu, False)


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e5m2"])
def test_an_fp8_kv_cache_runs_the_triton_kernels(tiny_llama, kv_dtype: str) -> None:  # noqa: ANN001
    """Named with TRITON_ATTN, and the default on CUDA (the device's type decides it: no
    GPU needed to ask), in either FP8 format."""
    fp8 = config(tiny_llama, attention_backend="TRITON_ATTN", kv_cache_dtype=kv_dtype)
    assert choose_kernels(fp8, torch.device("cpu"), False).name == "TRITON_ATTN"
    default = config(tiny_llama, kv_cache_dtype=kv_dtype)
    assert _backend_name(default, torch.device("cuda")) == "TRITON_ATTN"


def with_kv_scales(model_dir: Path, out_dir: Path, scales: tuple[float, float]) -> Path:
    """`model_dir` with per-layer k_scale / v_scale tensors in its checkpoint."""
    shutil.copytree(model_dir, out_dir)
    weights = load_file(model_dir / "model.safetensors")
    layers = {int(name.split(".")[2]) for name in weights if name.startswith("model.layers.")}
    for layer in layers:
        weights[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(scales[0])
        weights[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(scales[1])
    save_file(weights, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir


@pytest.mark.slow
@pytest.mark.parametrize("fp8", ["kv_cache", "kv_cache_e5m2", "weights"])
def test_the_triton_engine_over_fp8_generates_what_the_torch_engine_does(
    tiny_llama, tmp_path, fp8: str
) -> None:  # noqa: ANN001
    """--kv-cache-dtype fp8 (or fp8_e5m2) with a checkpoint's scales (the torch engine's
    cache written and read by model/kv_fp8.py), or --quantization fp8 (its weights
    dequantized by torch operators): chunked prefill, prefix hits and decode give the torch
    engine's tokens and logprobs."""
    if fp8.startswith("kv_cache"):
        kv_dtype = "fp8_e5m2" if fp8.endswith("e5m2") else "fp8"
        path, kwargs = with_kv_scales(tiny_llama, tmp_path / "scaled", (0.37, 2.5)), {
            "kv_cache_dtype": kv_dtype}  # fmt: skip
    else:
        path, kwargs = tiny_llama, {"quantization": "fp8", "hf_overrides": FP8_WEIGHTS}
    runs = {}
    for backend in ("TORCH_SDPA", "TRITON_ATTN"):
        llm = engine(path, backend, max_num_batched_tokens=24, **kwargs)
        model = llm.engine.runner.model.model
        if fp8 != "weights":
            assert model.layers[0].self_attn.kv_scales == (pytest.approx(0.37), 2.5)
        else:
            assert model.layers[0].mlp.down_proj.weight.dtype == torch.float8_e4m3fn
        runs[backend] = outputs(llm, PROMPTS) + outputs(llm, PROMPTS)
        llm.shutdown()
    for want, got in zip(runs["TORCH_SDPA"], runs["TRITON_ATTN"], strict=True):
        assert got.token_ids == want.token_ids
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert a.keys() == b.keys()
            assert max(abs(a[t].logprob - b[t].logprob) for t in a) < 1e-5
