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

    def model(self, arch: str, state: WeightState, adapter: Path | None) -> torch.nn.Module:
        key = (state.key, None if adapter is None else str(adapter))
        if key in self._models:
            self._models.move_to_end(key)
            return self._models[key]
        model = _build(self.configs[arch], state, adapter)
        self._models[key] = model
        if len(self._models) > MAX_MODELS:
            self._models.popitem(last=False)
        return model

    def score(
        self, arch: str, state: WeightState, adapter: Path | None, ids: tuple[int, ...]
    ) -> Scored:
        key = (state.key, None if adapter is None else str(adapter), ids)
        if key in self._scores:
            self._scores.move_to_end(key)
            return self._scores[key]
        scored = self._forward(self.model(arch, state, adapter), arch != "llama", ids)
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


def _build(config: object, state: WeightState, adapter: Path | None) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    assert state.tensors is not None, "no reference for weights that were incomplete"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state.tensors, strict=True)
    if adapter is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, adapter)
    return model.eval()
