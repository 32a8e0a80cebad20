"""A trainer's LoRA adapter pushed through a weight-transfer backend (ipc, in process):
created by its first round, updated by later ones (all or nothing), each commit a new
version of that adapter only; outputs checked against the trainer's own peft forward."""

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
    TensorSource,
    WeightTransferTrainerFactory,
)

PROMPT = [5, 17, 33, 80, 101, 7, 9, 41, 12, 250, 3, 77]
GREEDY = SamplingParams(max_tokens=5, temperature=0, logprobs=0)
POLICY = LoRARequest("policy", 1)  # no path: the adapter the trainer pushes


def peft_policy(model_dir: Path, seed: int = 0):  # noqa: ANN201
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                             init_lora_weights=False)  # fmt: skip
    policy = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2)
    return policy.eval()


def logprobs(llm: LLM, lora: LoRARequest | None) -> tuple[list[int], list[float]]:
    out = llm.generate([{"prompt_token_ids": PROMPT}], GREEDY, use_tqdm=False,
                       lora_request=lora)[0].outputs[0]  # fmt: skip
    return out.token_ids, [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)]


def reference(policy, tokens: list[int]) -> list[float]:  # noqa: ANN001
    with torch.no_grad():
        logits = policy(torch.tensor([PROMPT + tokens])).logits[0]
    scores = torch.log_softmax(logits.float(), -1)[len(PROMPT) - 1 : -1]
    return scores.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist()


@pytest.fixture()
def engine(tiny_llama: Path):  # noqa: ANN201
    llm = LLM(str(tiny_llama), dtype="float32", enable_lora=True, max_lora_rank=16,
              weight_transfer_config={"backend": "ipc"}, progress=False)  # fmt: skip
    return llm, InProcessWeightSyncClient(llm)


def test_pushed_adapter_serves_the_trainers_policy_version_by_version(tiny_llama, engine) -> None:
    llm, client = engine
    policy = peft_policy(tiny_llama)
    trainer = WeightTransferTrainerFactory.trainer_init(IPCTrainerInitInfo(), client,
                                                        adapter_source(policy))  # fmt: skip
    base_version = llm.get_weight_info()["version"]
    answer = push_adapter(trainer, policy, "policy")
    assert answer is not None and (answer.lora_name, answer.lora_version) == ("policy", 1)
    tokens, got = logprobs(llm, POLICY)
    assert got == pytest.approx(reference(policy, tokens), abs=1e-5)
    assert llm.list_lora_adapters() == [
        {"lora_name": "policy", "lora_path": None, "version": 1, "rank": 8}
    ]
    with torch.no_grad():  # an optimizer step, in place
        for name, param in policy.named_parameters():
            if "lora_" in name:
                param.add_(torch.randn_like(param) * 0.1)
    push_adapter(trainer, policy, "policy")
    tokens, got = logprobs(llm, POLICY)
    assert got == pytest.approx(reference(policy, tokens), abs=1e-5)
    assert llm.list_lora_adapters()[0]["version"] == 2
    assert llm.get_weight_info()["version"] == base_version  # the base weights never moved
    base_tokens, _ = logprobs(llm, None)
    assert base_tokens == logprobs(LLM(str(tiny_llama), dtype="float32", progress=False), None)[0]


def test_partial_rounds_change_only_what_they_send_and_bad_rounds_change_nothing(
    tiny_llama, engine
) -> None:
    llm, client = engine
    policy = peft_policy(tiny_llama, seed=1)
    trainer = WeightTransferTrainerFactory.trainer_init(IPCTrainerInitInfo(), client,
                                                        adapter_source(policy))  # fmt: skip
    push_adapter(trainer, policy, "policy")
    before = logprobs(llm, POLICY)
    name = "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight"
    live = name.replace("lora_B.weight", "lora_B.default.weight")
    target = dict(policy.named_parameters())[live]
    with torch.no_grad():
        target.mul_(3.0)
    source = TensorSource([(name, target.detach())])
    one = WeightTransferTrainerFactory.trainer_init(IPCTrainerInitInfo(), client, source)
    one.send_weights(lora_name="policy")
    tokens, got = logprobs(llm, POLICY)
    assert got == pytest.approx(reference(policy, tokens), abs=1e-5)
    assert (tokens, got) != before
    after = logprobs(llm, POLICY)
    bad = [  # wrong shape; a module the adapter lacks; a new adapter sent in part
        (TensorSource([(name, torch.zeros(64, 4))]), "policy", None),
        (
            TensorSource([(name.replace("down_proj", "up_proj"), torch.zeros(64, 8))]),
            "policy",
            None,
        ),  # fmt: skip
        (
            TensorSource([(name, target.detach())]),
            "fresh",
            {"r": 8, "lora_alpha": 16, "target_modules": ["down_proj"]},
        ),  # fmt: skip
    ]
    for source, lora_name, config in bad:
        sender = WeightTransferTrainerFactory.trainer_init(IPCTrainerInitInfo(), client, source)
        with pytest.raises(InvalidArgument):
            sender.send_weights(lora_name=lora_name, lora_config=config)
        assert [a["lora_name"] for a in llm.list_lora_adapters()] == ["policy"]
        assert llm.list_lora_adapters()[0]["version"] == 2
        assert logprobs(llm, POLICY) == after
        assert not llm.engine.weight_sync.round_open
