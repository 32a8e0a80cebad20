"""Reading a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) into the
model's own layout: for each of the model's linear layers it targets, per output shard of
the fused layers (q/k/v in `qkv_proj`, gate/up in `gate_up_proj`), the A matrix and the B
matrix with the adapter's scaling folded in.

Every check runs before anything is kept, so a refused adapter changes nothing; refusals
name the file and key at fault. Paths are confined by the caller (the engine), which
knows the allowed directories.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from hotswap.errors import InvalidArgument
from hotswap.lora.experts import build_expert_layers, is_expert_module, parse_target_parameters
from hotswap.lora.files import CONFIG_FILE, WEIGHTS_FILE

# The projections an adapter may target: the decoder's linear layers.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PEFT_PREFIX = "base_model.model."
_KEY = re.compile(r"(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight")
# adapter_config.json keys whose non-default values change what the adapter computes in
# ways the engine does not implement: refused, never silently ignored.
_UNSUPPORTED = {
    "use_dora": False,
    "fan_in_fan_out": False,
    "lora_bias": False,
    "modules_to_save": None,
}
_MAX_PATTERN_CHARS = 256  # a rank_pattern or alpha_pattern key (a regular expression)
_ids = itertools.count(1)


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str  # PEFT's: names, "all-linear" or a regex
    # PEFT's stacked parameters: a mixture of experts' routed experts (lora/experts.py)
    target_parameters: tuple[str, ...] = ()
    # PEFT's per-module r and lora_alpha: (pattern, value) in the config's order; a module
    # takes the first pattern that matches the end of its name (peft's get_pattern_key)
    rank_pattern: tuple[tuple[str, int], ...] = ()
    alpha_pattern: tuple[tuple[str, float], ...] = ()

    def rank_of(self, module: str) -> int:
        """`module`'s r (`model.layers.0.self_attn.q_proj`)."""
        return int(_pattern_value(self.rank_pattern, module, self.rank))

    def scaling_of(self, module: str) -> float:
        """What `module`'s B is multiplied by: its alpha over its r (or sqrt(r), rsLoRA)."""
        return self.scaling_for(module, self.rank_of(module))

    def scaling_for(self, module: str, rank: int) -> float:
        alpha = _pattern_value(self.alpha_pattern, module, self.alpha)
        return alpha / (math.sqrt(rank) if self.use_rslora else rank)

    @property
    def max_rank(self) -> int:
        """The largest r of any module: the columns a step reads of the adapter's slot."""
        return max([self.rank, *(rank for _, rank in self.rank_pattern)])

    @classmethod
    def parse(
        cls, raw: Any, max_rank: int, field: str = "lora_path", where: str = CONFIG_FILE
    ) -> AdapterConfig:
        """The config's LoRA settings; refusals name `field` and say `where`."""
        if not isinstance(raw, dict):
            raise InvalidArgument(field, f"{where}: must be a JSON object")
        peft_type = raw.get("peft_type", "LORA")
        if peft_type != "LORA":
            raise InvalidArgument(field, f"{where}: peft_type {peft_type!r} is not LORA")
        rank = raw.get("r")
        if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
            raise InvalidArgument(field, f"{where}: r must be a positive integer")
        if rank > max_rank:
            raise InvalidArgument(field, f"{where}: r = {rank} exceeds --max-lora-rank {max_rank}")
        alpha = _number(raw.get("lora_alpha", 8))
        if alpha is None:
            raise InvalidArgument(field, f"{where}: lora_alpha must be a number")
        for key, default in _UNSUPPORTED.items():
            if raw.get(key, default) not in (default, None, [], {}, False):
                raise InvalidArgument(field, f"{where}: {key} = {raw[key]!r} is not supported")
        if raw.get("bias", "none") != "none":
            raise InvalidArgument(field, f"{where}: bias {raw['bias']!r} is not supported")
        ranks = _patterns(raw.get("rank_pattern"), f"{where}: rank_pattern", field,
                          lambda v: _positive_rank(v, max_rank),
                          f"an integer in [1, --max-lora-rank {max_rank}]")  # fmt: skip
        alphas = _patterns(raw.get("alpha_pattern"), f"{where}: alpha_pattern", field, _number,
                           "a number")  # fmt: skip
        parameters = parse_target_parameters(raw.get("target_parameters"), field, where)
        modules = raw.get("target_modules")
        targets = () if parameters and modules in (None, []) else _targets(modules, field, where)
        return cls(rank, alpha, bool(raw.get("use_rslora", False)), targets, parameters,
                   ranks, alphas)  # fmt: skip


def _pattern_value(patterns: tuple[tuple[str, Any], ...], module: str, default: Any) -> Any:
    for pattern, value in patterns:
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default


def _patterns(value: Any, where: str, field: str, check: Any,
              wanted: str) -> tuple[tuple[str, Any], ...]:  # fmt: skip
    """A rank_pattern or alpha_pattern: {regular expression: value}; `check` gives the
    value or None if it is not `wanted` (refused)."""
    if value in (None, {}):
        return ()
    if not isinstance(value, dict):
        raise InvalidArgument(field, f"{where}: must be a JSON object")
    found = []
    for key, item in value.items():
        try:
            if len(key) > _MAX_PATTERN_CHARS:
                raise re.error("too long")
            re.compile(key)
        except re.error as e:
            raise InvalidArgument(field, f"{where}: {key[:80]!r} is not a pattern ({e})") from None
        checked = check(item)
        if checked is None:
            raise InvalidArgument(field, f"{where}: {key[:80]!r}: {item!r} is not {wanted}")
        found.append((key, checked))
    return tuple(found)


def _positive_rank(value: Any, max_rank: int) -> int | None:
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= max_rank:
        return value
    return None


def _number(value: Any) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _targets(value: Any, field: str, where: str) -> tuple[str, ...] | str:
    if isinstance(value, str) and value:
        return value
    if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
        unknown = sorted(set(value) - set(TARGETS))
        if unknown:
            raise InvalidArgument(
                field,
                f"{where}: target_modules {unknown} are not supported (the decoder's "
                f"linear layers are: {', '.join(TARGETS)})",
            )
        return tuple(sorted(set(value)))
    raise InvalidArgument(field, f"{where}: target_modules must be a non-empty list or a string")


@dataclass
class AdapterWeights:
    """One loaded version of an adapter. `uid` is unique per loaded version in this
    process: KV computed under it is cached under it (a reload under the same name gets a
    new uid, so it never reuses the old one's blocks). `layers` maps the model's linear
    layer (e.g. `model.layers.3.self_attn.qkv_proj`) to {shard: (A [r, in], B [out, r])},
    and a mixture of experts' routed experts (`model.layers.3.mlp.experts`) to
    {"gate_up_proj" / "down_proj": (A [experts, r, in], B [experts, out, r])}, B already
    multiplied by the scaling."""

    name: str
    path: str | None
    config: AdapterConfig
    layers: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]
    # The PEFT tensors as loaded, by canonical name (`canonical_name`): what a weight
    # round updates (only the tensors it sends change).
    raw: dict[str, torch.Tensor] = field(default_factory=dict)
    version: int = 1  # of this name: 1 for the first load, +1 per reload
    uid: int = field(default_factory=lambda: next(_ids))

    @property
    def rank(self) -> int:
        """Its largest r (a module's own may be smaller: PEFT's rank_pattern)."""
        return self.config.max_rank

    def num_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for shards in self.layers.values()
                   for a, b in shards.values())  # fmt: skip


def read_adapter_config(directory: Path, max_rank: int) -> AdapterConfig:
    path = directory / CONFIG_FILE
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise InvalidArgument("lora_path", f"lora_path: no {CONFIG_FILE} in it") from None
    except (OSError, ValueError, RecursionError) as e:
        raise InvalidArgument("lora_path", f"{CONFIG_FILE}: not readable JSON ({e})") from None
    return AdapterConfig.parse(raw, max_rank)


def read_adapter_tensors(directory: Path) -> dict[str, torch.Tensor]:
    path = directory / WEIGHTS_FILE
    if not path.is_file():
        raise InvalidArgument("lora_path", f"lora_path: no {WEIGHTS_FILE} in it")
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as e:
        raise InvalidArgument("lora_path", f"{WEIGHTS_FILE}: not readable ({e})") from None


def build_adapter(
    name: str,
    path: str | None,
    config: AdapterConfig,
    tensors: dict[str, torch.Tensor],
    model: Any,
    dtype: torch.dtype,
) -> AdapterWeights:
    """The adapter in the model's layout; InvalidArgument (field `lora_path`) naming the
    tensor when one does not fit the model (unknown module, missing half, wrong shape or
    rank). `model` provides `checkpoint_view(name)` (the decoder models do)."""
    pairs = _pairs(tensors.items())
    expert_pairs = {m: pair for m, pair in pairs.items() if is_expert_module(m)}
    layers: dict[str, dict[Any, tuple[torch.Tensor, torch.Tensor]]] = {}
    if expert_pairs:
        layers.update(build_expert_layers(expert_pairs, config, model, dtype, config.max_rank))
    elif config.target_parameters:
        raise InvalidArgument("lora_path", f"{WEIGHTS_FILE}: target_parameters "
                              f"{list(config.target_parameters)} have no lora_A/lora_B "
                              "tensors")  # fmt: skip
    targeted: set[str] = set()
    for module, (a, b) in sorted(pairs.items()):
        if module in expert_pairs:
            continue
        projection = module.rsplit(".", 1)[-1]
        if projection not in TARGETS:
            raise InvalidArgument(
                "lora_path", f"{WEIGHTS_FILE}: {module} is not a layer an adapter may target"
            )
        targeted.add(projection)
        key, shape, shard = _target(model, module)
        _check_pair(module, a, b, shape, config.rank_of(module))
        b_scaled = (b.float() * config.scaling_of(module)).to(dtype)
        layers.setdefault(key, {})[shard] = (a.to(dtype).contiguous(), b_scaled.contiguous())
    _check_finite(pairs)
    if isinstance(config.target_modules, tuple):
        missing = sorted(set(config.target_modules) - targeted)
        if missing:
            raise InvalidArgument(
                "lora_path",
                f"{WEIGHTS_FILE}: target_modules {missing} have no lora_A/lora_B tensors",
            )
    if not layers:
        raise InvalidArgument("lora_path", f"{WEIGHTS_FILE}: holds no LoRA tensors")
    raw = {canonical_name(key): tensor for key, tensor in tensors.items()}
    return AdapterWeights(name, path, config, layers, raw)


def canonical_name(name: str) -> str:
    """PEFT's tensor names in one spelling: `model.layers.0.self_attn.q_proj.lora_A.weight`
    (without peft's `base_model.model.` prefix, or the adapter-name segment a live peft
    model's parameters carry: `lora_A.default.weight`)."""
    match = _KEY.fullmatch(name.removeprefix(_PEFT_PREFIX))
    if match is None:
        return name
    return f"{match['module']}.lora_{match['ab']}.weight"


def _pairs(items: Iterable[tuple[str, torch.Tensor]]) -> dict[str, tuple[Any, Any]]:
    found: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in items:
        match = _KEY.fullmatch(key.removeprefix(_PEFT_PREFIX))
        if match is None:
            raise InvalidArgument(
                "lora_path", f"{WEIGHTS_FILE}: {key} is not a lora_A/lora_B weight"
            )
        found.setdefault(match["module"], {})[match["ab"]] = tensor
    for module, halves in found.items():
        if set(halves) != {"A", "B"}:
            missing = "lora_B" if "A" in halves else "lora_A"
            raise InvalidArgument("lora_path", f"{WEIGHTS_FILE}: {module}.{missing} is missing")
    return {module: (halves["A"], halves["B"]) for module, halves in found.items()}


def _target(model: Any, module: str) -> tuple[str, tuple[int, ...], int]:
    """(the model's linear layer, the whole shape of the checkpoint weight the module
    adapts, shard). Whole: a tensor-parallel rank holds a slice of that weight, and of
    the adapter (lora/layers.py `rank_part`)."""
    try:
        view = model.checkpoint_view(f"{module}.weight")
        shape = model.checkpoint_shape(f"{module}.weight")
    except ValueError:
        view = None
    if view is None:
        raise InvalidArgument("lora_path", f"{WEIGHTS_FILE}: {module} is not a layer of this model")
    key = view[0]
    param, _, shard = key.partition("#")
    if shard and not shard.isdigit():  # "expert.part": a slice of stacked experts
        raise InvalidArgument(
            "lora_path", f"{WEIGHTS_FILE}: {module} is a routed expert; adapters on a "
            "mixture of experts may target attention, shared experts and dense layers"
        )  # fmt: skip
    if param.startswith("visual."):
        raise InvalidArgument(
            "lora_path", f"{WEIGHTS_FILE}: {module} is in the vision tower; adapters may "
            "target the language model's layers"
        )  # fmt: skip
    return param.removesuffix(".weight"), shape, int(shard or 0)


def _check_pair(
    module: str, a: torch.Tensor, b: torch.Tensor, shape: tuple[int, ...], rank: int
) -> None:
    out_features, in_features = shape
    expected = {"lora_A": (rank, in_features), "lora_B": (out_features, rank)}
    for half, tensor in (("lora_A", a), ("lora_B", b)):
        if not tensor.is_floating_point():
            raise InvalidArgument(
                "lora_path", f"{WEIGHTS_FILE}: {module}.{half} has dtype {tensor.dtype}"
            )
        if tuple(tensor.shape) != expected[half]:
            raise InvalidArgument(
                "lora_path",
                f"{WEIGHTS_FILE}: {module}.{half} has shape {tuple(tensor.shape)}, the model "
                f"and r = {rank} need {expected[half]}",
            )


def _check_finite(pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The L1 norm of every tensor in one fused call (hundreds of tensors: an operator
    each would cost more than the rest of a load): NaN and inf always reach it, so finite
    norms mean finite tensors. Otherwise the culprit is looked for and named."""
    tensors = [t for pair in pairs.values() for t in pair]
    norms = torch._foreach_norm(tensors, 1)  # as torch's own clip_grad_norm_ does
    if bool(torch.stack([n.float() for n in norms]).isfinite().all()):
        return
    for module, (a, b) in sorted(pairs.items()):
        for half, tensor in (("lora_A", a), ("lora_B", b)):
            if not torch.isfinite(tensor).all():
                raise InvalidArgument(
                    "lora_path", f"{WEIGHTS_FILE}: {module}.{half} holds non-finite values"
                )


def load_adapter(
    name: str, directory: Path, model: Any, dtype: torch.dtype, max_rank: int
) -> AdapterWeights:
    """Read and check the adapter in `directory` (already confined by the caller)."""
    config = read_adapter_config(directory, max_rank)
    return build_adapter(name, str(directory), config, read_adapter_tensors(directory),
                         model, dtype)  # fmt: skip
