"""The Llama decoder family (Llama, Qwen2, Qwen3 differ only in biases and q/k norms).

Checkpoint q/k/v projections load into one fused `qkv_proj`, gate/up into `gate_up_proj`;
`load_weights` maps Hugging Face names onto these, from any iterable of tensors.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from hotswap.errors import InvalidArgument
from hotswap.model.attention import AttentionBackend, AttentionMetadata
from hotswap.model.kernels import CpuKernels, LayerKernels
from hotswap.model.layers import Linear, MatVec, linear, tiled_linear, use_kernels
from hotswap.model.models.decoder import MLP, DecoderModel
from hotswap.model.models.sharding import (
    gather_logits,
    head_layout,
    parameter_slice,
    vocab_rows,
)
from hotswap.model.models.spec import DecoderSpec
from hotswap.model.packed import PackedWeight, packed_copy
from hotswap.model.parallel import ShardSlice, TPGroup, check_whole_shape
from hotswap.model.quantized import (
    SCALE_NAME,
    quantize_into,
    quantize_linear,
    scale_name_of,
    scale_view_for,
)
from hotswap.model.reference_views import note_codes_as_sent, reference_view, set_reference
from hotswap.quantization.fp8 import FP8_DTYPE, Fp8Config

# checkpoint projection name -> (fused parameter name, shard index)
_FUSED_SHARDS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_SHARD_SOURCES = {fused_shard: proj for proj, fused_shard in _FUSED_SHARDS.items()}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# Linear layers FP8 leaves in the model dtype, as vLLM does: a mixture of experts' router
# and shared-expert gate (their logits decide routing).
_UNQUANTIZED_SUFFIXES = (".gate", ".shared_expert_gate")


class LlamaForCausalLM(nn.Module):
    qkv_bias: bool | None = None  # None: follow config.attention_bias
    o_bias: bool | None = None
    qk_norm = False
    qk_norm_per_head = True
    compilable = True  # decode steps may run as compiled graphs (execution/compiled.py)
    tensor_parallel = True  # splits over ranks (sharding.py); else refused with a TP size

    @property
    def graphable(self) -> bool:
        """Whether decode steps may replay as CUDA graphs (execution/cuda_graphs.py)."""
        return True

    def __init__(
        self,
        hf_config: dict[str, Any],
        dtype: torch.dtype,
        backend: AttentionBackend,
        batch_invariant: bool = False,
        head_dtype: torch.dtype | None = None,
        tp: TPGroup | None = None,
    ) -> None:
        super().__init__()
        self.tp = tp = tp or TPGroup()
        if tp.parallel and not self.tensor_parallel:
            raise InvalidArgument(
                "tensor_parallel_size",
                f"tensor_parallel_size: {type(self).__name__} does not run tensor-parallel "
                f"yet; use tensor_parallel_size=1",
            )
        spec = DecoderSpec.from_hf(
            hf_config, qkv_bias=self.qkv_bias, o_bias=self.o_bias, qk_norm=self.qk_norm,
            qk_norm_per_head=self.qk_norm_per_head,
        )  # fmt: skip
        self.spec = spec
        self.read_config(hf_config)
        self.batch_invariant = batch_invariant
        self.matvec: MatVec | None = None
        self.head_packed: PackedWeight | None = None
        head_dtype = head_dtype or dtype
        self.model = DecoderModel(
            spec, dtype, backend, batch_invariant, head_dtype,
            lambda layer: self.make_mlp(layer, dtype, batch_invariant), tp,
        )  # fmt: skip
        if not spec.tie_word_embeddings:
            self.lm_head = nn.Parameter(
                torch.empty(vocab_rows(spec.vocab_size, tp)[2], spec.hidden_size,
                            dtype=head_dtype), False,
            )  # fmt: skip

    def read_config(self, hf_config: dict[str, Any]) -> None:
        """What a subclass reads from config.json beyond `self.spec`, before the layers are
        built (mixture-of-experts models: their experts)."""

    def make_mlp(self, layer: int, dtype: torch.dtype, invariant: bool) -> nn.Module:
        """Layer `layer`'s feed-forward block (mixture-of-experts models override it)."""
        return MLP(self.spec, dtype, invariant, tp=self.tp)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens if self.spec.tie_word_embeddings else self.lm_head

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            logits = tiled_linear(hidden, self.lm_head_weight, None).float()
        else:
            logits = linear(hidden, self.lm_head_weight, None, self.matvec, self.head_packed)
        return gather_logits(logits.float(), self.spec.vocab_size, self.tp)

    @property
    def local_heads(self) -> tuple[int, int]:
        """(query heads, key/value heads) this rank computes and caches."""
        layout = head_layout(self.spec, self.tp)
        return layout.heads, layout.kv_heads

    def use_kernels(self, kernels: LayerKernels | None) -> None:
        """Run single-row products (every linear layer and the LM head), norms and RoPE
        through hotswap's CPU kernels, or torch operators (None)."""
        use_kernels(self, kernels)
        self.matvec = kernels.gemv if kernels is not None else None

    def quantize(self, config: Fp8Config) -> None:
        """FP8 storage for the linear layers `config` quantizes, before any weight is
        loaded; each checkpoint tensor of a fused layer keeps its own block grid. Under
        tensor parallelism every rank's share must be whole blocks (vLLM's rule), or a
        rank's blocks would not be the checkpoint's."""
        for name, module in self.named_modules():
            if not isinstance(module, Linear) or name.endswith(_UNQUANTIZED_SUFFIXES):
                continue
            if config.quantizes(name):
                sizes = self.shard_sizes(name)
                if self.tp.parallel:
                    check_rank_blocks(name, sizes, module.weight.shape[1], config.block)
                quantize_linear(module, sizes, config)
        self._parameter_index = self._expected_keys = None

    def scale_keys(self, keys: set[str]) -> set[str]:
        """The scale keys a round's weight `keys` also wrote (quantized on receipt)."""
        scales = set()
        for key in keys:
            name, _, shard = key.partition("#")
            if self.quantized_layer(name) is not None:
                scales.add(self._scale_key(name, shard or None))
        return scales

    def checkpoint_fp8_layer(self, name: str) -> nn.Module | None:
        """The FP8 linear layer checkpoint tensor `name` is written to, if it is one."""
        target = self._map_name(name)
        return None if target is None else self.quantized_layer(target[0])

    def quantized_layer(self, param_name: str) -> nn.Module | None:
        """The FP8 linear layer whose codes `param_name` is, if it is one."""
        if not param_name.endswith(".weight"):
            return None
        module = self.get_submodule(param_name[: -len(".weight")])
        return module if getattr(module, "fp8", None) is not None else None

    def prepack(self, kernels: CpuKernels | None = None) -> list[PackedWeight]:
        """Give every bf16 linear layer and the LM head packed copies (with `kernels`' AMX
        tiles where they apply), made now (not inside the first large step); returns them,
        for the runner to invalidate when the weights change (a step that needs one then
        repacks it)."""
        holders = []
        for module in self.modules():
            if isinstance(module, Linear) and module.weight.dtype == torch.bfloat16:
                module.packed = packed_copy(module.weight, kernels)
                holders.append(module.packed)
        if self.lm_head_weight.dtype == torch.bfloat16:
            self.head_packed = packed_copy(self.lm_head_weight, kernels)
            holders.append(self.head_packed)
        return holders

    def shard_sizes(self, module: str) -> list[int]:
        """Output sizes of a linear layer's checkpoint shards (fused: q/k/v, gate/up)."""
        if module.endswith("qkv_proj"):
            return list(self.model.layers[0].self_attn.split_sizes)
        if module.endswith("gate_up_proj"):  # a dense MLP's or a shared expert's
            return [self.get_submodule(module).weight.shape[0] // 2] * 2
        return [self.get_submodule(module).weight.shape[0]]

    def bind_kv_cache(self, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for layer, (k_cache, v_cache) in zip(self.model.layers, caches, strict=True):
            layer.self_attn.k_cache = k_cache
            layer.self_attn.v_cache = v_cache

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into the model's parameters. Returns the names of the
        model's own parameters that were (fully or partly) written."""
        params = self.parameter_index()
        loaded: set[str] = set()
        for name, tensor in weights:
            target = self._map_name(name)
            if target is not None:
                loaded |= self._load_one(params, name, target, tensor)
        return self.expand_keys(loaded)

    def _load_one(
        self,
        params: dict[str, nn.Parameter],
        name: str,
        target: tuple[str, Any],
        tensor: torch.Tensor,
    ) -> set[str]:
        """Checkpoint tensor `name` (whole) into this rank's share of `target` (its
        `_map_name`); returns its key, and its scales' where it was quantized here."""
        param_name, shard = target
        if param_name not in params:
            raise ValueError(f"weights: unknown parameter {name!r} (maps to {param_name!r})")
        dest, piece = self._rank_view(params[param_name], param_name, shard)
        check_whole_shape(
            name, tensor, dest.shape if piece is None else piece.full_shape(dest.shape)
        )
        part = tensor if piece is None else piece.take(tensor)
        key = self._key(param_name, shard)
        owner = self.quantized_layer(param_name)
        if owner is not None and part.dtype != FP8_DTYPE:
            quantize_into(owner.fp8, dest, scale_view_for(owner, dest), part)
            set_reference(reference_view(owner, dest), part)  # keep_reference: as sent
            return {key, self._scale_key(param_name, shard)}
        if part.dtype == FP8_DTYPE and (owner is None or self.tp.parallel):
            raise ValueError(
                f"weights: {name!r} is FP8; FP8 checkpoints load into an FP8 model "
                f"(quantization_config) without tensor parallelism"
            )
        dest.copy_(part)
        if owner is not None:  # FP8 codes as they came: the reference is derived later
            note_codes_as_sent(owner, dest)
        return {key}

    def expected_checkpoint_keys(self) -> set[str]:
        """What load_weights must have seen for the model to be complete (fused params
        count once per shard)."""
        if getattr(self, "_expected_keys", None) is None:
            self._expected_keys = frozenset(self._list_expected_keys())
        return set(self._expected_keys)

    def _list_expected_keys(self) -> set[str]:
        keys = set()
        for name, _ in self.named_parameters():
            if name.endswith(_fused("qkv_proj")):
                keys.update(f"{name}#{i}" for i in range(3))
            elif name.endswith(_fused("gate_up_proj")):
                keys.update(f"{name}#{i}" for i in range(2))
            else:
                keys.add(name)
        return keys

    def parameter_index(self) -> dict[str, nn.Parameter]:
        """name -> parameter, built once (parameters keep their identity; sleep and
        loading only swap or write their data)."""
        if getattr(self, "_parameter_index", None) is None:
            self._parameter_index = dict(self.named_parameters())
        return self._parameter_index

    def checkpoint_view(self, name: str) -> tuple[str, torch.Tensor] | None:
        """Where checkpoint tensor `name` is loaded: (key as in `load_weights`' result,
        the parameter slice), or None for names the model ignores. ValueError if unknown."""
        target = self._map_name(name)
        if target is None:
            return None
        param_name, shard = target
        params = self.parameter_index()
        if param_name not in params:
            raise ValueError(f"weights: unknown parameter {name!r}")
        return self._key(param_name, shard), self._rank_view(params[param_name], param_name,
                                                             shard)[0]  # fmt: skip

    def checkpoint_slice(self, name: str) -> ShardSlice | None:
        """Which part of checkpoint tensor `name` this rank holds (its `checkpoint_view`);
        None: all of it (no tensor parallelism, a replicated or an ignored tensor)."""
        target = self._map_name(name)
        if target is None or not self.tp.parallel:
            return None
        param_name, shard = target
        return self._rank_view(self.parameter_index()[param_name], param_name, shard)[1]

    def checkpoint_shape(self, name: str) -> tuple[int, ...] | None:
        """The whole shape of checkpoint tensor `name` (this rank holds its
        `checkpoint_slice`); None for names the model ignores. ValueError if unknown."""
        target = self.checkpoint_view(name)
        if target is None:
            return None
        piece = self.checkpoint_slice(name)
        shape = tuple(target[1].shape)
        return shape if piece is None else piece.full_shape(shape)

    def _rank_view(
        self, param: torch.Tensor, name: str, shard: Any
    ) -> tuple[torch.Tensor, ShardSlice | None]:
        """Where a checkpoint tensor is written on this rank, and which slice of it."""
        dest = self._shard_view(param, name, shard)
        piece = parameter_slice(name, shard, dest, self.spec, self.tp)
        if piece is not None and piece.size != dest.shape[piece.dim]:
            dest = dest.narrow(piece.dim, 0, piece.size)  # the vocabulary's padding rows
        return dest, piece

    def checkpoint_name(self, key: str) -> str:
        """The checkpoint tensor a key of `expected_checkpoint_keys()` is loaded from
        (the inverse of `_map_name`), for error messages."""
        name, _, shard = key.partition("#")
        if name in ("model.embed_tokens", "lm_head"):
            return f"{name}.weight"
        if not shard:
            return name
        parts = name.split(".")
        parts[-2] = _SHARD_SOURCES[(parts[-2], int(shard))]
        return ".".join(parts)

    def expand_keys(self, keys: set[str]) -> set[str]:
        """`keys` with each key that stands for several expected keys (a stacked tensor of
        every expert) replaced by them; dense models have none."""
        return keys

    @classmethod
    def _scale_key(cls, weight_name: str, shard: Any) -> str:
        """The key of FP8 weight `weight_name`'s scales (`weight` -> `weight_scale_inv`)."""
        return cls._key(scale_name_of(weight_name), shard)

    @staticmethod
    def _key(param_name: str, shard: Any) -> str:
        return f"{param_name}#{shard}" if shard is not None else param_name

    def _map_name(self, name: str) -> tuple[str, Any] | None:
        if name.endswith(_IGNORED_SUFFIXES):
            return None
        if name == "lm_head.weight":
            return None if self.spec.tie_word_embeddings else ("lm_head", None)
        if name == "model.embed_tokens.weight":
            return "model.embed_tokens", None
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in _FUSED_SHARDS:
            fused, shard = _FUSED_SHARDS[parts[-2]]
            return ".".join([*parts[:-2], fused, parts[-1]]), shard
        return name, None

    def _shard_view(self, param: torch.Tensor, name: str, shard: Any) -> torch.Tensor:
        if shard is None:
            return param.data
        if name.endswith(SCALE_NAME):  # a fused FP8 layer's scales, one grid per shard
            return self.get_submodule(name.rsplit(".", 1)[0]).fp8.scale_view(param.data, shard)
        sizes = self.shard_sizes(name.rsplit(".", 1)[0])
        start = sum(sizes[:shard])
        return param.data.narrow(0, start, sizes[shard])


def _fused(module: str) -> tuple[str, ...]:
    """A fused layer's parameters, each loaded from one checkpoint tensor per shard."""
    return tuple(f"{module}.{kind}" for kind in ("weight", "bias", SCALE_NAME))


def check_rank_blocks(
    name: str, sizes: list[int], in_features: int, block: tuple[int, int]
) -> None:
    """A rank's rows of each shard and its input columns are whole FP8 blocks."""
    if any(size % block[0] for size in sizes) or in_features % block[1]:
        raise InvalidArgument(
            "quantization_config.weight_block_size",
            f"quantization_config.weight_block_size: {list(block)} does not divide "
            f"{name}'s share on this rank (rows {sizes}, columns {in_features}); choose "
            f"a block that does, or a smaller tensor_parallel_size",
        )
