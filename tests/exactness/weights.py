"""The weights a schedule can commit, and the ledger of what each committed version holds.

`WeightBank` writes tiny random checkpoints (seed 0 is the one engines start from) and
peft adapters once under one root, so every path lies inside the engine's allowed weight
directories. `plan_round` turns a `Round` step into the tensors a trainer sends and the
weights the engine must hold after the commit; the reference is built from the latter,
never read back from the engine.

Invariants: a `WeightState`'s key names its tensors exactly (equal keys, equal tensors),
so reference models can be cached by key; the ledger maps each committed version to the
state the driver sent for it, `UNKNOWN` where the engine's weights were incomplete (after
a level-2 sleep, until a whole model is loaded): no token may carry such a version.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tests.exactness.schedule import Round
from tests.helpers.tiny_models import write_peft_adapter, write_tiny_model

NUM_SEEDS = 4  # checkpoints per architecture; seed 0 is the engines' starting weights
# adapters: (rank, targets); every one loadable with max_lora_rank 8
ADAPTERS = (
    (4, ("q_proj", "v_proj")),
    (8, ("q_proj", "k_proj", "v_proj", "o_proj")),
    (2, ("gate_proj", "up_proj", "down_proj", "q_proj")),
)


@dataclass(frozen=True)
class WeightState:
    key: str  # names the tensors exactly
    tensors: dict[str, torch.Tensor] | None  # transformers' state-dict names; None: unknown


UNKNOWN = WeightState("unknown", None)


class WeightBank:
    """Checkpoints (by architecture and seed) and adapters, written lazily under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._dirs: dict[tuple[str, int], Path] = {}
        self._states: dict[tuple[str, int], WeightState] = {}
        self._adapters: dict[int, Path] = {}

    def model_dir(self, arch: str, seed: int = 0) -> Path:
        key = (arch, seed % NUM_SEEDS)
        if key not in self._dirs:
            self._dirs[key] = write_tiny_model(self.root / f"{arch}-{key[1]}", arch, key[1])
        return self._dirs[key]

    def state(self, arch: str, seed: int = 0, fp8: bool = False) -> WeightState:
        """A checkpoint's weights; `fp8`: as an FP8 engine holds them (dequantized)."""
        key = (arch, seed % NUM_SEEDS)
        if key not in self._states:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(self.model_dir(*key), dtype=torch.float32)
            tensors = {name: t.detach().clone() for name, t in model.state_dict().items()}
            self._states[key] = WeightState(f"{arch}/seed{key[1]}", tensors)
        state = self._states[key]
        return as_served(state, state.key + "/fp8") if fp8 else state

    def adapter_dir(self, index: int) -> Path:
        index %= len(ADAPTERS)
        if index not in self._adapters:
            rank, targets = ADAPTERS[index]
            out = self.root / f"adapter-{index}"
            base = self.model_dir("llama")
            self._adapters[index] = write_peft_adapter(base, out, rank, targets, seed=index)
        return self._adapters[index]


@dataclass(frozen=True)
class PlannedRound:
    """What a round sends and what the engine holds after it commits."""

    after: WeightState
    sent: tuple[tuple[str, torch.Tensor], ...] = ()  # a trainer's tensors (checkpoint names)
    directory: Path | None = None  # a disk round's checkpoint


def plan_round(
    step: Round, current: WeightState, bank: WeightBank, arch: str, fp8: bool = False
) -> PlannedRound:
    """The tensors of `step` and the weights after it, from the current weights. `fp8`:
    the trainer sends its float32 tensors and the engine holds them quantized (`after`
    dequantized: what the reference runs)."""
    seed = 1 + step.seed % (NUM_SEEDS - 1)  # another checkpoint than the starting one
    other, served = bank.state(arch, seed), bank.state(arch, seed, fp8)
    if step.kind == "relabel":
        return PlannedRound(current)
    if step.kind == "disk":
        return PlannedRound(served, directory=bank.model_dir(arch, seed))
    if step.kind in ("whole", "aborted"):
        return PlannedRound(served, tuple(other.tensors.items()))
    assert current.tensors is not None, "partial rounds need known weights"
    rng = random.Random(step.seed)
    if step.kind == "partial":
        names = sorted(other.tensors)
        chosen = rng.sample(names, rng.randint(1, max(1, len(names) // 3)))
        sent = {name: other.tensors[name] for name in sorted(chosen)}
    elif step.kind == "sparse":
        sent = _perturbed(current.tensors, rng)
    else:
        raise ValueError(f"round kind: {step.kind!r}")
    key = f"{current.key}+{step.kind}{step.seed}"
    after = WeightState(key, {**current.tensors, **sent})
    return PlannedRound(as_served(after, key) if fp8 else after, tuple(sent.items()))


FP8_BLOCK = (16, 16)
# The checkpoint tensors an FP8 engine stores quantized: the attention and MLP projections
# (a shared expert's and the routed experts' too, stacked or per expert); not the
# embeddings, norms or router.
_FP8_SUFFIXES = (
    *(f"{p}_proj.weight" for p in ("q", "k", "v", "o", "gate", "up", "down")),
    ".mlp.experts.gate_up_proj",
    ".mlp.experts.down_proj",
)


def as_served(state: WeightState, key: str) -> WeightState:
    """`state` as an FP8 engine serves it: each projection quantized (vLLM's blockwise
    arithmetic, as the engine's quantizer) and dequantized to float32. Quantizing a
    dequantized tensor gives it back, so unchanged tensors and blocks stay as they were
    (a delta requantizes only the blocks it touches)."""
    from hotswap.quantization.fp8 import dequantize_blockwise, quantize_blockwise

    def served(tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 3:  # stacked experts: each expert's matrix quantized alone
            return torch.stack([served(matrix) for matrix in tensor])
        codes, scales = quantize_blockwise(tensor, FP8_BLOCK)
        return dequantize_blockwise(codes, scales, FP8_BLOCK, torch.float32)

    tensors = dict(state.tensors)
    for name, tensor in tensors.items():
        if name.endswith(_FP8_SUFFIXES):
            tensors[name] = served(tensor)
    return WeightState(key, tensors)


def _perturbed(tensors: dict[str, torch.Tensor], rng: random.Random) -> dict[str, torch.Tensor]:
    """A few tensors (never a stacked expert tensor: sparse deltas refuse those), each
    with ~5% of its elements moved."""
    names = sorted(n for n in tensors if ".experts." not in n)
    out = {}
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    for name in rng.sample(names, rng.randint(1, 3)):
        tensor = tensors[name]
        mask = torch.rand(tensor.shape, generator=gen) < 0.05
        noise = torch.randn(tensor.shape, generator=gen) * 0.5
        out[name] = torch.where(mask, tensor + noise, tensor)
    return out


@dataclass
class Ledger:
    """Committed versions -> weights, and LoRA (name, version) -> adapter directory, as the
    driver committed and loaded them."""

    current: int
    versions: dict[int, WeightState]
    adapters: dict[tuple[str, int], Path] = field(default_factory=dict)
    adapter_loads: dict[str, int] = field(default_factory=dict)
    # the version each committed through: "whole", "relabel", ... (for messages)
    how: dict[int, str] = field(default_factory=dict)

    @classmethod
    def starting(cls, version: int, state: WeightState) -> Ledger:
        return cls(version, {version: state}, how={version: "start"})

    @property
    def state(self) -> WeightState:
        return self.versions[self.current]

    def commit(self, version: int, state: WeightState, how: str) -> None:
        self.current = version
        self.versions[version] = state
        self.how[version] = how

    def load_adapter(self, name: str, path: Path) -> int:
        """The adapter version a load makes: 1 for the first under a name, +1 per reload."""
        version = self.adapter_loads.get(name, 0) + 1
        self.adapter_loads[name] = version
        self.adapters[(name, version)] = path
        return version
