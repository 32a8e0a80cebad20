"""The device path. Without a GPU, the model runs on PyTorch's `meta` device: every
parameter, KV block and step input must be made on the engine's device, and an op that
mixes in a tensor made on the host fails there just as it would on CUDA. With a GPU, the
engine on `cuda` generates the same greedy tokens as on the CPU."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from hotswap import LLM, SamplingParams
from hotswap.config import check_device
from hotswap.engine.request import Request
from hotswap.engine.scheduler import ScheduledRequest
from hotswap.engine_args import EngineArgs
from hotswap.execution.runner import ModelRunner
from hotswap.execution.step_inputs import plan_batch

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def meta_runner(path: Path, batch_invariant: bool) -> ModelRunner:
    config = EngineArgs(
        model=str(path), dtype="float32", num_kv_blocks=16, batch_invariant=batch_invariant
    ).create_engine_config()
    return ModelRunner(dataclasses.replace(config, device="meta"), progress=False)


def scheduled(request_id: str, prompt: list[int], blocks: list[int], start: int, n: int):  # noqa: ANN201
    request = Request(request_id, prompt, SamplingParams())
    request.block_ids = blocks
    return ScheduledRequest(request, start, n)


@pytest.mark.parametrize("batch_invariant", [False, True])
def test_a_mixed_step_keeps_every_tensor_on_the_engine_device(
    tiny_llama: Path, batch_invariant: bool
) -> None:
    runner = meta_runner(tiny_llama, batch_invariant)
    assert all(p.device.type == "meta" for p in runner.model.parameters())
    assert all(b.device.type == "meta" for b in runner.model.buffers())
    assert runner.kv_caches[0][0].device.type == "meta"
    items = [
        scheduled("decode-a", list(range(1, 21)), [0, 1], 19, 1),
        scheduled("decode-b", list(range(1, 40)), [2, 3, 4], 38, 1),
        scheduled("prefill", list(range(1, 30)), [5, 6], 0, 29),
        scheduled("chunk", list(range(1, 50)), [7, 8, 9, 10], 16, 20),  # after a cached prefix
    ]
    inputs = runner._inputs(plan_batch(items, runner.block_size))
    assert {t.device.type for t in (inputs.input_ids, inputs.positions, inputs.logits_rows)} == {
        "meta"
    }
    with torch.inference_mode():
        hidden = runner.model(inputs.input_ids, inputs.positions, inputs.meta)
        logits = runner.model.compute_logits(hidden[inputs.logits_rows])
    assert logits.device.type == "meta" and logits.shape[0] == 3  # "chunk" does not sample


def test_device_is_validated() -> None:
    assert check_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="device: 'tpu'"):
        check_device("tpu")
    with pytest.raises(ValueError, match="device: 'meta': only cpu and cuda"):
        check_device("meta")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            check_device("cuda")


@needs_cuda
def test_cuda_engine_generates_what_the_cpu_engine_does(tiny_llama: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    prompts = ["The quick brown", "Pause, swap the weights, resume", "x"]
    outputs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(str(tiny_llama), dtype="float32", device=device, progress=False)
        outputs[device] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert outputs["cuda"] == outputs["cpu"]


@needs_cuda
def test_a_cuda_mixture_of_experts_engine_matches_the_cpu_one(tiny_model_factory) -> None:  # noqa: ANN001
    path = tiny_model_factory("qwen3_moe")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    prompts = ["The quick brown", "a b c d e f g h i j k l m n o p"]
    outputs = {}
    for device in ("cpu", "cuda"):
        llm = LLM(str(path), dtype="float32", device=device, progress=False,
                  enable_return_routed_experts=True)  # fmt: skip
        outputs[device] = [o.outputs[0] for o in llm.generate(prompts, params)]
        llm.shutdown()
    for cpu, cuda in zip(outputs["cpu"], outputs["cuda"], strict=True):
        assert cuda.token_ids == cpu.token_ids
        assert (cuda.routed_experts == cpu.routed_experts).all()
        for want, got in zip(cpu.logprobs, cuda.logprobs, strict=True):
            assert max(abs(want[t].logprob - got[t].logprob) for t in want) < 1e-4


@needs_cuda
def test_sleep_on_cuda_frees_the_weights_and_wakes_to_the_same_tokens(tiny_llama: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(str(tiny_llama), dtype="float32", device="cuda", progress=False,
              enable_sleep_mode=True)  # fmt: skip
    before = [o.outputs[0].token_ids for o in llm.generate(["The quick brown"], params)]
    weights = sum(p.numel() * p.element_size() for p in llm.engine.runner.model.parameters())
    for level in (1, 2):
        awake = torch.cuda.memory_allocated()
        llm.call("sleep", level=level)
        assert awake - torch.cuda.memory_allocated() >= weights  # weights (and KV) left the GPU
        llm.call("wake_up")
        if level == 2:  # the weights were dropped: reloaded from disk
            llm.call("load_weights_from_disk", model_path=str(tiny_llama))
        after = [o.outputs[0].token_ids for o in llm.generate(["The quick brown"], params)]
        assert after == before
    llm.shutdown()
