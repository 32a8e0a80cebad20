"""The Llama decoder family (Llama, Qwen2, Qwen3 differ only in biases and q/k norms).

Checkpoint q/k/v projections load into one fused `qkv_proj`, gate/up into `gate_up_proj`;
`load_weights` maps Hugging Face names onto these, from any iterable of tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hotswap.model.attention import AttentionBackend, AttentionMetadata
from hotswap.model.kernels import CpuKernels
from hotswap.model.layers import (
    Linear,
    MatVec,
    RMSNorm,
    RopeTable,
    RotaryEmbedding,
    apply_rotary,
    linear,
    silu_and_mul,
    tiled_linear,
    use_kernels,
)
from hotswap.model.models.spec import DecoderSpec
from hotswap.model.packed import PackedWeight, packed_copy


class Attention(nn.Module):
    def __init__(
        self, spec: DecoderSpec, dtype: torch.dtype, backend: AttentionBackend, invariant: bool
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            spec.num_heads,
            spec.num_kv_heads,
            spec.head_dim,
        )
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = Linear(
            spec.hidden_size, q_size + 2 * kv_size, spec.qkv_bias, dtype, invariant
        )
        self.o_proj = Linear(q_size, spec.hidden_size, spec.o_bias, dtype, invariant)
        if spec.qk_norm:
            q_norm, k_norm = (spec.head_dim,) * 2 if spec.qk_norm_per_head else (q_size, kv_size)
            self.q_norm = RMSNorm(q_norm, spec.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(k_norm, spec.rms_norm_eps, dtype)
        self.qk_norm = spec.qk_norm and spec.qk_norm_per_head
        self.qk_norm_whole = spec.qk_norm and not spec.qk_norm_per_head
        self.clip_qkv = spec.clip_qkv
        self.backend = backend
        self.scale = spec.head_dim**-0.5
        # The paged KV cache, bound by the runner; buffers, so a compiled graph takes them
        # as inputs (a cache re-allocated after sleep is seen, not baked in).
        self.register_buffer("k_cache", torch.empty(0, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.empty(0, dtype=dtype), persistent=False)
        self.kernels: CpuKernels | None = None  # RoPE in place when set

    def forward(self, rope: RopeTable, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.qk_norm_whole or self.clip_qkv is not None:
            qkv = self._whole_qk_norm_and_clip(qkv)
        heads, kv_heads = self.num_heads, self.num_kv_heads
        v = qkv[:, -self.split_sizes[2] :].view(tokens, kv_heads, self.head_dim)
        qk = qkv[:, : -self.split_sizes[2]].view(tokens, heads + kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = qk.split([heads, kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        # q and k rotate together: one set of elementwise ops instead of two.
        if self.kernels is not None:
            self.kernels.rotary_embedding(qk, *rope)  # in place: qkv is this step's own
        else:
            qk = apply_rotary(qk, rope)
        q, k = qk.split([heads, kv_heads], dim=1)
        if self.k_cache.numel() == 0:
            raise RuntimeError("attention: no KV cache is bound to the model")
        out = self.backend.forward(q, k, v, (self.k_cache, self.v_cache), meta, self.scale)
        return self.o_proj(out.reshape(tokens, -1))

    def _whole_qk_norm_and_clip(self, qkv: torch.Tensor) -> torch.Tensor:
        """OLMoE: q and k each normalised as one vector (before the heads are split), then
        q, k and v clamped to +-clip_qkv, in transformers' order."""
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        if self.qk_norm_whole:
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        qkv = torch.cat([q, k, v], dim=-1)
        if self.clip_qkv is not None:
            qkv.clamp_(-self.clip_qkv, self.clip_qkv)
        return qkv


class MLP(nn.Module):
    def __init__(
        self, spec: DecoderSpec, dtype: torch.dtype, invariant: bool, size: int | None = None
    ) -> None:
        super().__init__()
        size = size or spec.intermediate_size
        self.gate_up_proj = Linear(spec.hidden_size, 2 * size, spec.mlp_bias, dtype, invariant)
        self.down_proj = Linear(size, spec.hidden_size, spec.mlp_bias, dtype, invariant)
        self.kernels: CpuKernels | None = None  # the fused activation when set

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.kernels is not None and gate_up.dim() == 2:
            return self.down_proj(self.kernels.silu_and_mul(gate_up))
        return self.down_proj(silu_and_mul(gate_up))


class DecoderLayer(nn.Module):
    """`mlp`: the dense MLP, or a mixture-of-experts block (model/moe.py)."""

    def __init__(
        self,
        spec: DecoderSpec,
        dtype: torch.dtype,
        backend: AttentionBackend,
        invariant: bool,
        mlp: nn.Module,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.self_attn = Attention(spec, dtype, backend, invariant)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.mlp = mlp

    def forward(
        self,
        rope: RopeTable,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(MLP output, residual stream): the caller adds the two, fused into the next
        norm (the first layer gets residual None: x is the stream)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(rope, h, meta), residual)
        return self.mlp(h), residual


class DecoderModel(nn.Module):
    """`head_dtype` is the dtype of the final norm (and of the embedding when the LM head
    shares it): the hidden states the head reads are then never rounded to `dtype`."""

    def __init__(
        self,
        spec: DecoderSpec,
        dtype: torch.dtype,
        backend: AttentionBackend,
        invariant: bool,
        head_dtype: torch.dtype,
        make_mlp: Callable[[int], nn.Module],
    ) -> None:
        super().__init__()
        embed_dtype = head_dtype if spec.tie_word_embeddings else dtype
        self.embed_tokens = nn.Parameter(
            torch.empty(spec.vocab_size, spec.hidden_size, dtype=embed_dtype), False
        )
        self.layers = nn.ModuleList(
            DecoderLayer(spec, dtype, backend, invariant, make_mlp(i))
            for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, head_dtype)
        self.rotary = RotaryEmbedding(spec.head_dim, spec.max_positions, spec.rope)
        self.dtype = dtype

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        x = F.embedding(input_ids, self.embed_tokens).to(self.dtype)
        rope = self.rotary(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(rope, x, residual, meta)
        return self.norm(x, residual)[0] if residual is not None else self.norm(x)


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


class LlamaForCausalLM(nn.Module):
    qkv_bias: bool | None = None  # None: follow config.attention_bias
    o_bias: bool | None = None
    qk_norm = False
    qk_norm_per_head = True
    compilable = True  # decode steps may run as compiled graphs (model/compiled.py)

    def __init__(
        self,
        hf_config: dict[str, Any],
        dtype: torch.dtype,
        backend: AttentionBackend,
        batch_invariant: bool = False,
        head_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
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
            lambda layer: self.make_mlp(layer, dtype, batch_invariant),
        )  # fmt: skip
        if not spec.tie_word_embeddings:
            self.lm_head = nn.Parameter(
                torch.empty(spec.vocab_size, spec.hidden_size, dtype=head_dtype), False
            )

    def read_config(self, hf_config: dict[str, Any]) -> None:
        """What a subclass reads from config.json beyond `self.spec`, before the layers are
        built (mixture-of-experts models: their experts)."""

    def make_mlp(self, layer: int, dtype: torch.dtype, invariant: bool) -> nn.Module:
        """Layer `layer`'s feed-forward block (mixture-of-experts models override it)."""
        return MLP(self.spec, dtype, invariant)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens if self.spec.tie_word_embeddings else self.lm_head

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.batch_invariant:
            return tiled_linear(hidden, self.lm_head_weight, None).float()
        return linear(hidden, self.lm_head_weight, None, self.matvec, self.head_packed).float()

    def use_kernels(self, kernels: CpuKernels | None) -> None:
        """Run single-row products (every linear layer and the LM head), norms and RoPE
        through hotswap's CPU kernels, or torch operators (None)."""
        use_kernels(self, kernels)
        self.matvec = kernels.gemv if kernels is not None else None

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
            if target is None:
                continue
            param_name, shard = target
            if param_name not in params:
                raise ValueError(f"weights: unknown parameter {name!r} (maps to {param_name!r})")
            dest = self._shard_view(params[param_name], param_name, shard)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"weights: shape mismatch for {name!r}: checkpoint {tuple(tensor.shape)}, "
                    f"model expects {tuple(dest.shape)}"
                )
            dest.copy_(tensor)
            loaded.add(self._key(param_name, shard))
        return self.expand_keys(loaded)

    def expected_checkpoint_keys(self) -> set[str]:
        """What load_weights must have seen for the model to be complete (fused params
        count once per shard)."""
        if getattr(self, "_expected_keys", None) is None:
            self._expected_keys = frozenset(self._list_expected_keys())
        return set(self._expected_keys)

    def _list_expected_keys(self) -> set[str]:
        keys = set()
        for name, _ in self.named_parameters():
            if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
                keys.update(f"{name}#{i}" for i in range(3))
            elif name.endswith(("gate_up_proj.weight", "gate_up_proj.bias")):
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
        return self._key(param_name, shard), self._shard_view(params[param_name], param_name, shard)

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
        sizes = self.shard_sizes(name.rsplit(".", 1)[0])
        start = sum(sizes[:shard])
        return param.data.narrow(0, start, sizes[shard])
