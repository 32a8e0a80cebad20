"""LoRA adapters in the engine, against peft's own forward (float32)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hotswap import LLM, LoRARequest, SamplingParams
from hotswap.errors import InvalidArgument
from tests.helpers.tiny_models import peft_reference, write_peft_adapter

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
PROMPT = [5, 17, 33, 80, 101, 7, 9, 41, 12, 250, 3, 77, 64, 18, 90, 23, 45, 8, 150, 31]
GREEDY = SamplingParams(max_tokens=6, temperature=0, logprobs=0)
# (rank, targets): each target set, and ranks 1, 8 and 64
ADAPTERS = {
    "attn-r8": (8, ATTENTION),
    "mlp-r8": (8, MLP),
    "all-r1": (1, ATTENTION + MLP),
    "all-r64": (64, ATTENTION + MLP),
    "qv-r8": (8, ("q_proj", "v_proj")),
}


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: write_peft_adapter(tiny_llama, root / name, rank, targets, seed=i)
        for i, (name, (rank, targets)) in enumerate(ADAPTERS.items())
    }


@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", enable_lora=True, max_loras=4,
               max_lora_rank=64, num_kv_blocks=256, progress=False)  # fmt: skip


def reference_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    logprobs = torch.log_softmax(logits, -1)[len(prompt) - 1 : -1]
    return logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0]


def run(llm: LLM, lora: LoRARequest | None, prompt: list[int] = PROMPT):
    out = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False, lora_request=lora)
    return out[0]


def sampled_logprobs(completion) -> list[float]:
    return [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_logprobs_equal_peft(llm: LLM, tiny_llama: Path, adapters, name: str) -> None:
    output = run(llm, LoRARequest(name, 1, str(adapters[name])))
    completion = output.outputs[0]
    reference = peft_reference(tiny_llama, adapters[name])
    expected = reference_logprobs(reference, PROMPT, completion.token_ids)
    got = torch.tensor(sampled_logprobs(completion))
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
    # greedy: each token is the reference's argmax too
    with torch.no_grad():
        logits = reference(torch.tensor([PROMPT + completion.token_ids])).logits[0]
    assert logits[len(PROMPT) - 1 : -1].argmax(-1).tolist() == completion.token_ids
    # and the adapter matters: the base model scores these tokens otherwise
    base = reference_logprobs(peft_reference(tiny_llama, None), PROMPT, completion.token_ids)
    assert (base - expected).abs().max() > 1e-3


def test_rslora_scaling(llm: LLM, tiny_llama: Path, tmp_path: Path) -> None:
    path = write_peft_adapter(tiny_llama, tmp_path / "rs", 16, ATTENTION, seed=9, use_rslora=True)
    completion = run(llm, LoRARequest("rslora", 1, str(path))).outputs[0]
    expected = reference_logprobs(peft_reference(tiny_llama, path), PROMPT, completion.token_ids)
    assert torch.allclose(torch.tensor(sampled_logprobs(completion)), expected, atol=1e-5)
    llm.unload_lora_adapter("rslora")


def test_a_reload_never_serves_blocks_cached_under_the_old_adapter(
    llm: LLM, tiny_llama: Path, adapters
) -> None:
    first, second = adapters["attn-r8"], adapters["all-r1"]
    llm.load_lora_adapter("reloaded", str(first))
    old = run(llm, LoRARequest("reloaded", 1, str(first)))
    again = run(llm, LoRARequest("reloaded", 1, str(first)))
    assert again.num_cached_tokens > 0  # the prompt's blocks are cached under this version
    llm.load_lora_adapter("reloaded", str(second), load_inplace=True)
    new = run(llm, LoRARequest("reloaded", 1, str(second)))
    assert new.num_cached_tokens == 0  # not the blocks computed under the old weights
    completion = new.outputs[0]
    expected = reference_logprobs(peft_reference(tiny_llama, second), PROMPT,
                                  completion.token_ids)  # fmt: skip
    assert torch.allclose(torch.tensor(sampled_logprobs(completion)), expected, atol=1e-5)
    assert sampled_logprobs(completion) != sampled_logprobs(old.outputs[0])
    assert llm.list_lora_adapters()[-1]["version"] == 2
    # provenance: every token names the adapter version that produced it
    spans = [(s.lora_name, s.lora_version) for s in completion.weight_versions]
    assert spans == [("reloaded", 2)]
    assert [(s.lora_name, s.lora_version) for s in old.outputs[0].weight_versions] == [
        ("reloaded", 1)
    ]
    llm.unload_lora_adapter("reloaded")


@pytest.mark.parametrize("invariant", [True, False], ids=["batch-invariant", "batched"])
def test_mixed_step_equals_each_alone(tiny_llama: Path, adapters, invariant: bool) -> None:
    """Base rows and three adapters in one step: bitwise each run alone in batch-invariant
    mode (per segment, fixed tiles); within float32 rounding when the segments run as one
    padded batch (the default)."""
    llm = LLM(str(tiny_llama), dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=64,
              batch_invariant=invariant, enable_prefix_caching=False, progress=False)  # fmt: skip
    loras = [None] + [LoRARequest(n, i + 1, str(adapters[n]))
                      for i, n in enumerate(("attn-r8", "mlp-r8", "all-r64"))]  # fmt: skip
    assert_mixed_step_equals_each_alone(llm, loras, invariant)


def assert_mixed_step_equals_each_alone(llm: LLM, loras: list, invariant: bool = False) -> None:
    """One prompt per entry of `loras` (an adapter or None), all in one generate call:
    each equals its prompt run alone (bitwise where `invariant`, else within 1e-5)."""
    prompts = [{"prompt_token_ids": PROMPT[: 12 + i]} for i in range(len(loras))]
    mixed = llm.generate(prompts, GREEDY, use_tqdm=False, lora_request=loras)
    for prompt, lora, together in zip(prompts, loras, mixed):
        alone = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0]
        assert alone.outputs[0].token_ids == together.outputs[0].token_ids
        expected = sampled_logprobs(alone.outputs[0])
        got = sampled_logprobs(together.outputs[0])
        assert got == expected if invariant else got == pytest.approx(expected, abs=1e-5)
    outputs = {tuple(o.outputs[0].token_ids) for o in mixed}
    assert len(outputs) > 1  # the adapters changed what was generated


def test_more_adapters_than_slots_wait_for_one(tiny_llama: Path, adapters) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=64,
              progress=False)  # fmt: skip
    loras = [LoRARequest(n, 1, str(adapters[n])) for n in ("attn-r8", "mlp-r8", "attn-r8")]
    together = llm.generate([{"prompt_token_ids": PROMPT}] * 3, GREEDY, use_tqdm=False,
                            lora_request=loras)  # fmt: skip
    for lora, output in zip(loras, together):
        alone = run(llm, lora).outputs[0]
        assert output.outputs[0].token_ids == alone.token_ids
        assert sampled_logprobs(output.outputs[0]) == pytest.approx(sampled_logprobs(alone),
                                                                   abs=1e-5)  # fmt: skip


def test_least_recently_used_adapter_is_evicted_and_read_again(tiny_llama: Path, adapters) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", enable_lora=True, max_loras=1, max_cpu_loras=2,
              max_lora_rank=64, progress=False)  # fmt: skip
    for name in ("attn-r8", "mlp-r8", "qv-r8"):
        llm.load_lora_adapter(name, str(adapters[name]))
    assert [a["lora_name"] for a in llm.list_lora_adapters()] == ["mlp-r8", "qv-r8"]
    first = LoRARequest("attn-r8", 1, str(adapters["attn-r8"]))
    completion = run(llm, first).outputs[0]  # read again from its path
    expected = reference_logprobs(peft_reference(tiny_llama, adapters["attn-r8"]), PROMPT,
                                  completion.token_ids)  # fmt: skip
    assert torch.allclose(torch.tensor(sampled_logprobs(completion)), expected, atol=1e-5)


def _edited(source: Path, target: Path, **config) -> Path:
    shutil.copytree(source, target)
    path = target / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    return target


def _bad_adapters(root: Path, adapters, tiny_model_factory) -> dict[str, tuple[Path, str]]:
    """name -> (adapter directory, words the refusal must contain)"""
    source = adapters["attn-r8"]
    other = tiny_model_factory("llama", hidden_size=32)
    outside = Path(os.path.realpath("/tmp")) / f"hotswap-outside-{os.getpid()}"
    shutil.rmtree(outside, ignore_errors=True)
    shutil.copytree(source, outside)
    (root / "link").symlink_to(outside)
    nan = root / "nan"
    shutil.copytree(source, nan)
    tensors = load_file(nan / "adapter_model.safetensors")
    next(t for k, t in sorted(tensors.items()) if "lora_B" in k)[0, 0] = float("nan")
    save_file(tensors, nan / "adapter_model.safetensors")
    missing = root / "no-config"
    shutil.copytree(source, missing)
    (missing / "adapter_config.json").unlink()
    return {
        "rank": (_edited(source, root / "rank", r=128), "max-lora-rank"),
        "targets": (
            _edited(source, root / "targets", target_modules=[*ATTENTION, "up_proj"]),
            "up_proj",
        ),  # fmt: skip
        "unsupported": (_edited(source, root / "dora", use_dora=True), "use_dora"),
        "experts": (
            _edited(source, root / "experts", target_parameters=["mlp.experts.down_proj"]),
            "target_parameters",
        ),
        "pattern rank": (
            _edited(source, root / "prank", rank_pattern={"q_proj": 128}),
            "rank_pattern",
        ),
        "pattern regex": (
            _edited(source, root / "pregex", alpha_pattern={"q_(proj": 2}),
            "alpha_pattern",
        ),
        "pattern shape": (_edited(source, root / "pshape", rank_pattern={"q_proj": 4}), "shape"),
        "shape": (write_peft_adapter(other, root / "shape", 8, ATTENTION), "shape"),
        "declared rank": (_edited(source, root / "declared", r=4), "shape"),
        "outside": (outside, "outside"),
        "symlink": (root / "link", "outside"),
        "no config": (missing, "adapter_config.json"),
        "nan": (nan, "non-finite"),
    }


def test_rank_and_alpha_patterns_equal_peft(llm: LLM, tiny_llama: Path, tmp_path: Path) -> None:
    """peft's per-module r and lora_alpha (the first pattern matching the end of a module's
    name), as peft itself writes and applies them."""
    path = write_peft_adapter(
        tiny_llama, tmp_path / "patterns", 8, ATTENTION + MLP, seed=7,
        rank_pattern={"q_proj": 4, r"layers\.1\.mlp\.down_proj": 16},
        alpha_pattern={"v_proj": 64, r"layers\.0\..*o_proj": 2},
    )  # fmt: skip
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["rank_pattern"] and config["alpha_pattern"]  # peft wrote them
    completion = run(llm, LoRARequest("patterns", 9, str(path))).outputs[0]
    expected = reference_logprobs(peft_reference(tiny_llama, path), PROMPT, completion.token_ids)
    got = torch.tensor(sampled_logprobs(completion))
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
    listed = {a["lora_name"]: a for a in llm.list_lora_adapters()}
    assert listed["patterns"]["rank"] == 16  # its largest r
    llm.unload_lora_adapter("patterns")


def test_bad_adapters_are_refused_naming_the_field_and_change_nothing(
    llm: LLM, adapters, tiny_model_factory, tmp_path: Path
) -> None:
    llm.load_lora_adapter("kept", str(adapters["mlp-r8"]))
    before = llm.list_lora_adapters()
    kept = run(llm, LoRARequest("kept", 1, str(adapters["mlp-r8"]))).outputs[0]
    for case, (path, words) in _bad_adapters(tmp_path, adapters, tiny_model_factory).items():
        for name in ("kept", "new"):  # a reload in place is refused just the same
            with pytest.raises(InvalidArgument) as refused:
                llm.load_lora_adapter(name, str(path), load_inplace=True)
            assert refused.value.field == "lora_path", case
            assert words in str(refused.value), (case, str(refused.value))
            assert llm.list_lora_adapters() == before, case
    again = run(llm, LoRARequest("kept", 1, str(adapters["mlp-r8"]))).outputs[0]
    assert again.token_ids == kept.token_ids
    with pytest.raises(InvalidArgument) as twice:
        llm.load_lora_adapter("kept", str(adapters["mlp-r8"]))
    assert twice.value.field == "lora_name"
    llm.unload_lora_adapter("kept")
    with pytest.raises(InvalidArgument, match="cannot be found"):
        llm.unload_lora_adapter("kept")


def test_base_rows_are_unchanged_by_enabling_lora(tiny_llama: Path, llm: LLM) -> None:
    plain = LLM(str(tiny_llama), dtype="float32", progress=False)
    expected = run(plain, None).outputs[0]
    got = run(llm, None).outputs[0]
    assert got.token_ids == expected.token_ids
    assert sampled_logprobs(got) == pytest.approx(sampled_logprobs(expected), abs=1e-6)


def test_lora_refused_when_not_enabled(tiny_llama: Path, adapters) -> None:
    plain = LLM(str(tiny_llama), dtype="float32", progress=False)
    with pytest.raises(Exception, match="--enable-lora"):
        run(plain, LoRARequest("a", 1, str(adapters["attn-r8"])))


@pytest.mark.slow  # an engine of its own
def test_adapters_on_a_mixture_of_experts_equal_peft(tiny_model_factory, tmp_path: Path) -> None:
    """Attention and the shared expert of Qwen2-MoE take adapters; routed experts do not."""
    model_dir = tiny_model_factory("qwen2_moe")
    path = write_peft_adapter(model_dir, tmp_path / "moe", 8, ATTENTION + MLP, seed=3)
    assert any(
        "shared_expert.gate_proj" in k for k in load_file(path / "adapter_model.safetensors")
    )
    llm = LLM(str(model_dir), dtype="float32", enable_lora=True, max_lora_rank=8, progress=False)
    completion = run(llm, LoRARequest("moe", 1, str(path))).outputs[0]
    expected = reference_logprobs(peft_reference(model_dir, path), PROMPT, completion.token_ids)
    got = torch.tensor(sampled_logprobs(completion))
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()
    tensors = load_file(path / "adapter_model.safetensors")
    prefix = "base_model.model.model.layers.0.mlp.experts.3.gate_proj"
    tensors[f"{prefix}.lora_A.weight"] = torch.zeros(8, 64)
    tensors[f"{prefix}.lora_B.weight"] = torch.zeros(32, 8)
    routed = shutil.copytree(path, tmp_path / "routed")
    save_file(tensors, str(routed / "adapter_model.safetensors"))
    with pytest.raises(InvalidArgument, match="routed expert"):
        run(llm, LoRARequest("routed", 2, str(routed)))
