"""LoRA on a mixture of experts' routed experts (hotswap/lora/experts.py): peft's
`target_parameters` adapters on the stacked gate_up_proj / down_proj, against peft's own
forward in float32, mixed in one batch with base rows and dense adapters, and refused
naming the field when they do not fit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hotswap import LLM, LoRARequest
from hotswap.errors import InvalidArgument
from tests.helpers.tiny_models import peft_reference, write_peft_adapter
from tests.lora.test_lora import (
    ATTENTION,
    GREEDY,
    PROMPT,
    assert_mixed_step_equals_each_alone,
    reference_logprobs,
    run,
    sampled_logprobs,
)

# Engines and peft models: slow.
pytestmark = pytest.mark.slow

BOTH = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def expert_adapter(model_dir: Path, out: Path, parameters: list[str], targets=ATTENTION,
                   rank: int = 4, seed: int = 0) -> Path:  # fmt: skip
    return write_peft_adapter(model_dir, out, rank, tuple(targets), seed=seed,
                              target_parameters=parameters)  # fmt: skip


def engine(model_dir: Path, **kw) -> LLM:
    return LLM(str(model_dir), dtype="float32", enable_lora=True, max_loras=4,
               max_lora_rank=8, progress=False, **kw)  # fmt: skip


def assert_equals_peft(llm: LLM, model_dir: Path, adapter: Path, name: str) -> list[int]:
    # vLLM's marker of a 3-D adapter, as a user moving from vLLM writes it: accepted
    completion = run(llm, LoRARequest(name, 1, str(adapter), is_3d_lora_weight=True)).outputs[0]
    expected = reference_logprobs(peft_reference(model_dir, adapter), PROMPT,
                                  completion.token_ids)  # fmt: skip
    got = torch.tensor(sampled_logprobs(completion))
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
    return completion.token_ids


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_expert_adapters_equal_peft(tiny_model_factory, tmp_path: Path, arch: str) -> None:
    model_dir = tiny_model_factory(arch)
    llm = engine(model_dir, enable_mixed_moe_lora_format=True)  # vLLM's flag: accepted
    both = expert_adapter(model_dir, tmp_path / "both", BOTH)
    keys = load_file(both / "adapter_model.safetensors")
    assert any(".experts.base_layer.lora_A" in k for k in keys)  # peft's nested wrappers
    tokens = assert_equals_peft(llm, model_dir, both, "both")
    # the experts' adapter matters: the same adapter without it scores otherwise
    attention = expert_adapter(model_dir, tmp_path / "attention", [])
    without = reference_logprobs(peft_reference(model_dir, attention), PROMPT, tokens)
    with_it = reference_logprobs(peft_reference(model_dir, both), PROMPT, tokens)
    assert (without - with_it).abs().max() > 1e-3
    # one stacked parameter alone, and experts only (no target_modules)
    down = expert_adapter(model_dir, tmp_path / "down", ["mlp.experts.down_proj"], seed=1)
    assert_equals_peft(llm, model_dir, down, "down")
    only = expert_adapter(model_dir, tmp_path / "only", BOTH, targets=(), seed=2)
    assert_equals_peft(llm, model_dir, only, "only")


def test_expert_adapters_batch_with_base_rows_and_dense_adapters(
    tiny_model_factory, tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("qwen3_moe")
    llm = engine(model_dir, enable_prefix_caching=False)
    paths = {
        "experts": expert_adapter(model_dir, tmp_path / "e", BOTH, seed=3),
        "dense": expert_adapter(model_dir, tmp_path / "d", [], seed=4),
        "experts-r8": expert_adapter(model_dir, tmp_path / "e8", BOTH, rank=8, seed=5),
    }
    loras = [None] + [LoRARequest(name, i + 1, str(path))
                      for i, (name, path) in enumerate(paths.items())]  # fmt: skip
    assert_mixed_step_equals_each_alone(llm, loras)


def _edited(source: Path, target: Path, config: dict | None = None,
            tensors: dict | None = None) -> Path:  # fmt: skip
    shutil.copytree(source, target)
    if config is not None:
        raw = json.loads((target / "adapter_config.json").read_text())
        (target / "adapter_config.json").write_text(json.dumps({**raw, **config}))
    if tensors is not None:
        save_file(tensors, str(target / "adapter_model.safetensors"))
    return target


def test_bad_expert_adapters_are_refused_naming_the_field(
    tiny_model_factory, tiny_llama: Path, tmp_path: Path
) -> None:
    model_dir = tiny_model_factory("qwen3_moe")
    good = expert_adapter(model_dir, tmp_path / "good", BOTH)
    tensors = load_file(good / "adapter_model.safetensors")
    key = next(k for k in tensors if k.endswith("experts.lora_A.weight"))
    fewer = {**tensors, key: tensors[key][: tensors[key].shape[0] // 2]}  # half the experts
    bad = {
        "unknown target_parameters": (
            _edited(good, tmp_path / "p", {"target_parameters": ["mlp.gate.weight"]}),
            "target_parameters",
        ),
        "no target_parameters": (
            _edited(good, tmp_path / "n", {"target_parameters": None}),
            "has no target_parameters",
        ),
        "expert count": (_edited(good, tmp_path / "c", tensors=fewer), "experts"),
        "rank over r": (_edited(good, tmp_path / "r", {"r": 2}), "adapter_config.json's r"),
    }
    llm = engine(model_dir)
    for name, (path, message) in bad.items():
        with pytest.raises(InvalidArgument, match=message) as refused:
            run(llm, LoRARequest(name, 1, str(path)))
        assert refused.value.field == "lora_path", name
    dense = engine(tiny_llama)
    with pytest.raises(InvalidArgument, match="no routed experts"):
        run(dense, LoRARequest("dense", 1, str(good)))


@pytest.mark.parametrize(
    ("arch", "expert_parallel"),
    [("qwen3_moe", False), ("qwen3_moe", True), ("qwen2_moe", True), ("mixtral", True)],
    ids=["tp", "ep", "ep-shared-expert", "ep-mixtral"],
)
def test_expert_adapters_on_two_ranks_equal_one_rank_and_peft(
    tiny_model_factory, tmp_path: Path, arch: str, expert_parallel: bool
) -> None:
    """Tensor parallelism: each rank holds its share of every expert's intermediate
    dimension and of the adapter (gate_up_proj: its gate and up rows of B; down_proj: its
    columns of A). Expert parallelism: each rank holds its experts whole, and the
    adapter's A and B of those experts only."""
    model_dir = tiny_model_factory(arch)
    down = ["mlp.experts.down_proj"]
    paths = [expert_adapter(model_dir, tmp_path / "a", BOTH, seed=6),
             expert_adapter(model_dir, tmp_path / "b", down, seed=7)]  # fmt: skip
    loras = [LoRARequest("a", 1, str(paths[0])), None, LoRARequest("b", 2, str(paths[1]))]
    prompts = [{"prompt_token_ids": PROMPT[: 10 + 3 * i]} for i in range(3)]
    single = engine(model_dir).generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    llm = engine(model_dir, tensor_parallel_size=2, enable_expert_parallel=expert_parallel)
    try:
        parallel = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
        held = llm.engine.runner.model.sparse_blocks()[0].experts.lora.a["gate_up_proj"]
        assert held.shape[1] == (4 if expert_parallel else 8)  # rank 0's experts of 8
    finally:
        llm.shutdown()
    for one, two, prompt, lora in zip(single, parallel, prompts, loras, strict=True):
        assert one.outputs[0].token_ids == two.outputs[0].token_ids
        got = sampled_logprobs(two.outputs[0])
        assert got == pytest.approx(sampled_logprobs(one.outputs[0]), abs=1e-5)
        model = peft_reference(model_dir, None if lora is None else Path(lora.lora_path))
        want = reference_logprobs(model, prompt["prompt_token_ids"], two.outputs[0].token_ids)
        assert torch.allclose(torch.tensor(got), want, atol=1e-5)


@pytest.mark.parametrize(
    ("parameters", "expert_parallel"),
    [(BOTH, False), (["mlp.experts.gate_up_proj"], False), (BOTH, True)],
    ids=["both", "gate-up", "both-ep"],
)
def test_an_expert_adapter_pushed_by_a_trainer_is_created_then_updated(
    tiny_model_factory, parameters: list[str], expert_parallel: bool
) -> None:
    """Through a weight-transfer backend, under peft's own tensor names: the first round
    creates the adapter (its expert tensors named as peft nests its wrappers), the next
    one changes it after an optimizer step; both equal the trainer's forward (under
    expert parallelism too: two ranks, each keeping its experts' part)."""
    import peft
    import transformers

    from hotswap.rl import adapter_source, push_adapter
    from hotswap.weight_transfer import (
        InProcessWeightSyncClient,
        IPCTrainerInitInfo,
        WeightTransferTrainerFactory,
    )

    model_dir = tiny_model_factory("qwen3_moe")
    parallel = {"tensor_parallel_size": 2, "enable_expert_parallel": True}
    llm = engine(model_dir, weight_transfer_config={"backend": "ipc"},
                 **(parallel if expert_parallel else {}))  # fmt: skip
    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(8)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"],
                             target_parameters=parameters, init_lora_weights=False)  # fmt: skip
    policy = peft.get_peft_model(base, config).eval()
    source = adapter_source(policy)
    trainer = WeightTransferTrainerFactory.trainer_init(
        IPCTrainerInitInfo(), InProcessWeightSyncClient(llm), source
    )
    try:
        for version in (1, 2):
            with torch.no_grad():  # a change the experts' adapter makes visible
                for name, param in policy.named_parameters():
                    if "lora_B" in name and "experts" in name:
                        param.normal_(0, 0.3)
            push_adapter(trainer, policy, "policy")
            completion = run(llm, LoRARequest("policy", 1)).outputs[0]
            want = reference_logprobs(policy, PROMPT, completion.token_ids)
            got = torch.tensor(sampled_logprobs(completion))
            assert torch.allclose(got, want, atol=1e-5), (version, (got - want).abs().max())
        assert llm.list_lora_adapters()[0]["version"] == 2
    finally:
        llm.shutdown()


def test_expert_adapters_on_fp8_experts_equal_peft_on_the_dequantized_model(
    tiny_model_factory, tmp_path: Path
) -> None:
    """With --quantization fp8 the experts hold codes: the adapter's slots take the
    activations' dtype (not float8), and the engine equals peft over the dequantized
    weights."""
    from tests.model.test_fp8 import QUANTIZED, dequantized_copy

    model_dir = tiny_model_factory("qwen3_moe")
    llm = engine(model_dir, quantization="fp8", hf_overrides=QUANTIZED)
    assert llm.engine.runner.model.model.layers[0].mlp.experts.gate_up_proj.dtype == (
        torch.float8_e4m3fn
    )
    adapter = expert_adapter(model_dir, tmp_path / "both", BOTH)
    completion = run(llm, LoRARequest("both", 1, str(adapter))).outputs[0]
    reference = peft_reference(dequantized_copy(model_dir, tmp_path / "dequantized"), adapter)
    expected = reference_logprobs(reference, PROMPT, completion.token_ids)
    got = torch.tensor(sampled_logprobs(completion))
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
