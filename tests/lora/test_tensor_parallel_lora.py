"""LoRA adapters under tensor parallelism (`tensor_parallel_size=2`), in float32: every
rank holds its part of each adapter (column-parallel layers their rows of B, row-parallel
ones their columns of A), placed in slots rank 0 decides. Checked against peft's forward
and against one rank: greedy tokens equal and logprobs within 1e-5, with key/value heads
split (Llama) and replicated (Qwen3 with one key/value head), a mixture of experts' shared
expert (Qwen2-MoE), several adapters and the base model in one step, more adapters than
slots, and an adapter pushed by a trainer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hotswap import LLM, LoRARequest, SamplingParams
from hotswap.errors import InvalidArgument
from hotswap.rl import adapter_source, push_adapter
from hotswap.weight_transfer import (
    InProcessWeightSyncClient,
    IPCTrainerInitInfo,
    WeightTransferTrainerFactory,
)
from tests.helpers.tiny_models import peft_reference, write_peft_adapter
from tests.rl.test_lora_push import peft_policy

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
PROMPTS = [[5, 17, 33, 80, 101, 7, 9, 41, 12], [250, 3, 77, 64, 18, 90, 23, 45, 8, 150, 31],
           [11, 12, 13, 14], [99, 98, 97, 96, 95, 94, 93, 92, 91, 90, 89, 88, 87, 86]]  # fmt: skip
GREEDY = SamplingParams(max_tokens=8, temperature=0, logprobs=1)
ADAPTERS = {"all-r8": (8, ATTENTION + MLP), "qv-r4": (4, ("q_proj", "v_proj")),
            "mlp-r16": (16, MLP)}  # fmt: skip


@pytest.fixture(scope="module", params=["llama", "qwen3", "qwen2_moe"])
def model_dir(request, tiny_model_factory):  # noqa: ANN001, ANN201
    """Llama: 2 key/value heads, one per rank; Qwen3 with 1: on both ranks; Qwen2-MoE:
    adapters on its shared expert, split as the dense MLP is."""
    if request.param == "qwen2_moe":
        return tiny_model_factory("qwen2_moe")
    kv_heads = 2 if request.param == "llama" else 1
    return tiny_model_factory(request.param, num_key_value_heads=kv_heads)


@pytest.fixture(scope="module")
def adapters(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: write_peft_adapter(model_dir, root / name, rank, targets, seed=i)
        for i, (name, (rank, targets)) in enumerate(ADAPTERS.items())
    }


def make(path: Path, tp: int, **kw) -> LLM:  # noqa: ANN003
    kw = {"dtype": "float32", "block_size": 8, "max_num_batched_tokens": 32, "max_loras": 2,
          "max_lora_rank": 16, "enable_lora": True, **kw}  # fmt: skip
    return LLM(str(path), tensor_parallel_size=tp, progress=False, **kw)


def run(llm: LLM, loras: list[LoRARequest | None]) -> list:
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    return [o.outputs[0] for o in llm.generate(prompts, GREEDY, use_tqdm=False,
                                               lora_request=loras)]  # fmt: skip


def sampled(completion) -> list[float]:  # noqa: ANN001
    return [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]


def reference(model, prompt: list[int], tokens: list[int]) -> list[float]:  # noqa: ANN001
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    scores = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
    return scores.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


def assert_same(single: list, parallel: list) -> None:
    for one, two in zip(single, parallel, strict=True):
        assert one.token_ids == two.token_ids
        assert sampled(one) == pytest.approx(sampled(two), abs=1e-5)


@pytest.mark.slow
def test_adapters_on_two_ranks_equal_peft_and_one_rank(model_dir: Path, adapters) -> None:
    requests = {name: LoRARequest(name, i + 1, str(path))
                for i, (name, path) in enumerate(adapters.items())}  # fmt: skip
    # three adapters and the base in one batch, two slots: slots are rewritten mid-run
    mixed = [requests["all-r8"], None, requests["qv-r4"], requests["mlp-r16"]]
    single = run(make(model_dir, 1), mixed)
    llm = make(model_dir, 2)
    try:
        parallel = run(llm, mixed)
        assert_same(single, parallel)
        for prompt, lora, completion in zip(PROMPTS, mixed, parallel, strict=True):
            model = peft_reference(model_dir, None if lora is None else Path(lora.lora_path))
            want = reference(model, prompt, completion.token_ids)
            assert sampled(completion) == pytest.approx(want, abs=1e-5)
        # the adapters' own tokens differ from the base model's: they were applied
        base = run(llm, [None] * len(PROMPTS))
        assert any(b.token_ids != p.token_ids for b, p in zip(base, parallel, strict=True))
        # a reload under the same name is a new version, placed anew on every rank
        llm.load_lora_adapter("all-r8", str(adapters["mlp-r16"]), load_inplace=True)
        again = run(llm, [LoRARequest("all-r8", 1)] * len(PROMPTS))  # as loaded
        assert_same(run(llm, [requests["mlp-r16"]] * len(PROMPTS)), again)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_an_adapter_pushed_by_a_trainer_reaches_every_rank(tiny_llama: Path) -> None:
    llm = make(tiny_llama, 2, weight_transfer_config={"backend": "ipc"})
    try:
        client = InProcessWeightSyncClient(llm)
        policy = peft_policy(tiny_llama)
        trainer = WeightTransferTrainerFactory.trainer_init(IPCTrainerInitInfo(), client,
                                                            adapter_source(policy))  # fmt: skip
        for _ in range(2):  # created by the first round, changed by the second
            push_adapter(trainer, policy, "policy")
            completion = run(llm, [LoRARequest("policy", 1)] * len(PROMPTS))[0]
            want = reference(policy, PROMPTS[0], completion.token_ids)
            assert sampled(completion) == pytest.approx(want, abs=1e-5)
            with torch.no_grad():  # an optimizer step, in place
                for name, param in policy.named_parameters():
                    if "lora_" in name:
                        param.add_(torch.randn_like(param) * 0.1)
        assert llm.list_lora_adapters()[0]["version"] == 2
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_an_adapter_that_does_not_fit_is_refused_whole(tiny_model_factory, tmp_path) -> None:  # noqa: ANN001
    """Checked against the checkpoint's whole shapes, not a rank's slice of them."""
    wide = tiny_model_factory("llama", intermediate_size=256)
    path = write_peft_adapter(wide, tmp_path / "wide", 4, MLP)
    llm = make(tiny_model_factory("llama"), 2)
    try:
        with pytest.raises(InvalidArgument, match="the model and r = 4 need") as refused:
            run(llm, [LoRARequest("wide", 1, str(path))] * len(PROMPTS))
        assert refused.value.field == "lora_path"
        assert llm.list_lora_adapters() == []
    finally:
        llm.shutdown()
