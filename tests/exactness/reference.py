"""The independent reference: transformers (and peft for LoRA) in float32 on the weights a
token's provenance names, fed the whole sequence in one plain forward with an explicit
all-ones attention mask (never `generate`, which masks every token equal to the pad id
unless it is given a mask; prompts here hold the pad id on purpose).

Invariants: one causal forward over prompt + output[:-1] gives, at each position, the
distribution of the next token given exactly the context before it, so every token of a
choice is scored by one forward per (weights, adapter); models are cached by weight key
and adapter, scores by (model, sequence); no hotswap code computes any of it.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from tests.exactness.weights import WeightState
from tests.helpers.moe import router_top_k

MAX_MODELS = 24
MAX_SCORES = 512


@dataclass(frozen=True, eq=False)
class Scored:
    """One forward: log-probabilities [positions, vocab] and, for a mixture of experts,
    router probabilities per position, layer and expert (dense layers: zeros) and the
    top-k experts [positions, layers, top_k] chosen from them."""

    logprobs: torch.Tensor
    router_probs: np.ndarray | None
    experts: np.ndarray | None


class Reference:
    def __init__(self, configs: dict[str, object]) -> None:
        self.configs = configs  # arch -> transformers config
        self._models: OrderedDict[tuple[str, str | None], torch.nn.Module] = OrderedDict()
        self._scores: OrderedDict[tuple, Scored] = OrderedDict()
        self.forwards = 0

    def model(
        self, arch: str, state: WeightState, adapter: Path | None, kv_fp8: bool = False
    ) -> torch.nn.Module:
        key = (state.key, None if adapter is None else str(adapter), kv_fp8)
        if key in self._models:
            self._models.move_to_end(key)
            return self._models[key]
        model = _build(self.configs[arch], state, adapter, kv_fp8)
        self._models[key] = model
        if len(self._models) > MAX_MODELS:
            self._models.popitem(last=False)
        return model

    def score(
        self,
        arch: str,
        state: WeightState,
        adapter: Path | None,
        ids: tuple[int, ...],
        kv_fp8: bool = False,
    ) -> Scored:
        """`kv_fp8`: attention reads keys and values quantized to e4m3 and back (scale
        1, as an FP8 cache without checkpoint scales holds them)."""
        key = (state.key, None if adapter is None else str(adapter), ids, kv_fp8)
        if key in self._scores:
            self._scores.move_to_end(key)
            return self._scores[key]
        model = self.model(arch, state, adapter, kv_fp8)
        scored = self._forward(model, arch != "llama", ids)
        self._scores[key] = scored
        if len(self._scores) > MAX_SCORES:
            self._scores.popitem(last=False)
        return scored

    def _forward(self, model: torch.nn.Module, moe: bool, ids: tuple[int, ...]) -> Scored:
        self.forwards += 1
        inputs = torch.tensor([ids])
        with torch.no_grad():
            out = model(
                input_ids=inputs,
                attention_mask=torch.ones_like(inputs),
                output_router_logits=moe or None,
            )
        logprobs = torch.log_softmax(out.logits[0].float(), dim=-1)
        if not moe:
            return Scored(logprobs, None, None)
        probs, experts = router_top_k(model, out.router_logits, len(ids))
        return Scored(logprobs, probs, experts)


FP8_KV_ATTENTION = "exactness_fp8_kv"  # transformers' attention, over quantized K/V


def _fp8_kv_attention(module, query, key, value, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
    """sdpa over keys and values as an FP8 cache (scale 1) gives them back: quantized with
    the engine's own rounding (saturated, nearest even), which vLLM's is too."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, query, _fp8(key), _fp8(value), *args, **kwargs)


def _fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype)


def _build(
    config: object, state: WeightState, adapter: Path | None, kv_fp8: bool = False
) -> torch.nn.Module:
    from transformers import AttentionInterface, AutoModelForCausalLM

    assert state.tensors is not None, "no reference for weights that were incomplete"
    extra = {}
    if kv_fp8:
        AttentionInterface.register(FP8_KV_ATTENTION, _fp8_kv_attention)
        extra["attn_implementation"] = FP8_KV_ATTENTION
    # from_config writes the attention implementation into the config it is given: a copy,
    # or every later model of this architecture would read quantized K/V too
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32, **extra)
    model.load_state_dict(state.tensors, strict=True)
    if adapter is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, adapter)
    return model.eval()
