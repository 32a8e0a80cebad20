"""The decoder body of the Llama family: attention, the dense MLP, the layer and the stack.
Each module holds this rank's share under tensor parallelism (sharding.py)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from hotswap.model.attention import AttentionBackend, AttentionMetadata
from hotswap.model.kernels import LayerKernels
from hotswap.model.kv_fp8 import take_first_step_scales
from hotswap.model.layers import (
    Linear,
    RMSNorm,
    RopeTable,
    RotaryEmbedding,
    apply_rotary,
    silu_and_mul,
)
from hotswap.model.models.sharding import (
    head_layout,
    local_intermediate,
    vocab_embedding,
    vocab_rows,
)
from hotswap.model.models.spec import DecoderSpec
from hotswap.model.parallel import TPGroup


class Attention(nn.Module):
    """This rank's heads (all of them without tensor parallelism: sharding.py)."""

    def __init__(
        self,
        spec: DecoderSpec,
        dtype: torch.dtype,
        backend: AttentionBackend,
        invariant: bool,
        tp: TPGroup,
    ) -> None:
        super().__init__()
        layout = head_layout(spec, tp)
        self.num_heads, self.num_kv_heads, self.head_dim = (
            layout.heads,
            layout.kv_heads,
            spec.head_dim,
        )
        q_size, kv_size = layout.heads * spec.head_dim, layout.kv_heads * spec.head_dim
        self.split_sizes = [q_size, kv_size, kv_size]
        self.qkv_proj = Linear(
            spec.hidden_size, q_size + 2 * kv_size, spec.qkv_bias, dtype, invariant
        )
        self.o_proj = Linear(q_size, spec.hidden_size, spec.o_bias, dtype, invariant)
        self.o_proj.reduce = tp if tp.parallel else None
        if spec.qk_norm:
            q_norm, k_norm = (spec.head_dim,) * 2 if spec.qk_norm_per_head else (q_size, kv_size)
            self.q_norm = RMSNorm(q_norm, spec.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(k_norm, spec.rms_norm_eps, dtype)
        self.qk_norm = spec.qk_norm and spec.qk_norm_per_head
        self.qk_norm_whole = spec.qk_norm and not spec.qk_norm_per_head
        # A whole q (k) spans every rank's heads: its sum of squares is summed across the
        # ranks, in which a key/value head replicated on r ranks counts r times; so the
        # means divide by q's size, and by k's times r (`_whole_norms`).
        self.tp = tp
        replicas = tp.size * layout.kv_heads // spec.num_kv_heads
        self.norm_sizes = torch.tensor(
            [
                float(spec.num_heads * spec.head_dim),
                float(spec.num_kv_heads * spec.head_dim * replicas),
            ]
        )
        self.clip_qkv = spec.clip_qkv
        self.backend = backend
        self.scale = spec.head_dim**-0.5
        # The paged KV cache, bound by the runner; buffers, so a compiled graph takes them
        # as inputs (a cache re-allocated after sleep is seen, not baked in).
        self.register_buffer("k_cache", torch.empty(0, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.empty(0, dtype=dtype), persistent=False)
        self.kernels: LayerKernels | None = None  # RoPE in place when set
        # FP8 KV cache (model/kv_fp8.py): the checkpoint's scales, and what the backend is
        # given: (k_scale, v_scale) with an FP8 cache, None (no quantization) otherwise.
        self.k_scale = self.v_scale = 1.0
        self.kv_scales: tuple[float, float] | None = None
        # --calculate-kv-scales: set for the first real step, which takes the scales
        self.calculate_kv_scales = False

    def forward(self, rope: RopeTable, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.qk_norm_whole or self.clip_qkv is not None:
            qkv = self._whole_qk_norm_and_clip(qkv)
        heads, kv_heads = self.num_heads, self.num_kv_heads
        v = qkv[:, -self.split_sizes[2] :].view(tokens, kv_heads, self.head_dim)
        qk = qkv[:, : -self.split_sizes[2]].view(tokens, heads + kv_heads, self.head_dim)
        if self.qk_norm:
            qk = self._head_norms(qk)
        # q and k rotate together: one set of elementwise ops instead of two.
        if self.kernels is not None:
            self.kernels.rotary_embedding(qk, *rope)  # in place: qkv is this step's own
        else:
            qk = apply_rotary(qk, rope)
        q, k = qk.split([heads, kv_heads], dim=1)
        if self.k_cache.numel() == 0:
            raise RuntimeError("attention: no KV cache is bound to the model")
        if self.calculate_kv_scales:  # before the backend writes any code (kv_fp8.py)
            take_first_step_scales(self, k, v)
        out = self.backend.forward(q, k, v, (self.k_cache, self.v_cache), meta, self.scale,
                                   self.kv_scales)  # fmt: skip
        return self.o_proj(out.reshape(tokens, -1))

    def _head_norms(self, qk: torch.Tensor) -> torch.Tensor:
        """Qwen3: each q head and each k head normalised on its own (one kernel, in place,
        where the kernels have one)."""
        fused = self.kernels.head_rms_norm if self.kernels is not None else None
        if fused is not None:
            fused(qk, self.q_norm.weight, self.k_norm.weight, self.num_heads, self.q_norm.eps)
            return qk
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)

    def _whole_qk_norm_and_clip(self, qkv: torch.Tensor) -> torch.Tensor:
        """OLMoE: q and k each normalised as one vector (before the heads are split), then
        q, k and v clamped to +-clip_qkv, in transformers' order."""
        q, k, v = qkv.split(self.split_sizes, dim=-1)
        if self.qk_norm_whole and self.tp.parallel:
            q, k = self._whole_norms(q, k)
        elif self.qk_norm_whole:
            q, k = self.q_norm(q.contiguous()), self.k_norm(k.contiguous())
        qkv = torch.cat([q, k, v], dim=-1)
        if self.clip_qkv is not None:
            qkv.clamp_(-self.clip_qkv, self.clip_qkv)
        return qkv

    def _whole_norms(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm of the whole q and k from this rank's part of each (as RMSNorm: in
        float32, scaled in the weight's dtype): one all-reduce of both sums of squares."""
        q32, k32 = q.float(), k.float()
        sums = torch.cat([q32.pow(2).sum(-1, keepdim=True), k32.pow(2).sum(-1, keepdim=True)],
                         dim=-1)  # fmt: skip
        means = self.tp.all_reduce(sums) / self.norm_sizes.to(sums.device)
        scales = torch.rsqrt(means + self.q_norm.eps)
        q_weight, k_weight = self.q_norm.weight, self.k_norm.weight
        q = q_weight * (q32 * scales[:, :1]).to(q_weight.dtype)
        return q, k_weight * (k32 * scales[:, 1:]).to(k_weight.dtype)


class MLP(nn.Module):
    """This rank's intermediate columns (all of them without tensor parallelism). `size`:
    another width than the config's intermediate_size, read from config key `field`;
    `reduce` False: the output stays this rank's partial sum (a mixture-of-experts block
    sums its shared expert with its routed experts, then reduces once)."""

    def __init__(
        self,
        spec: DecoderSpec,
        dtype: torch.dtype,
        invariant: bool,
        size: int | None = None,
        tp: TPGroup | None = None,
        field: str = "intermediate_size",
        reduce: bool = True,
    ) -> None:
        super().__init__()
        tp = tp or TPGroup()
        size = local_intermediate(size or spec.intermediate_size, tp, field)
        self.gate_up_proj = Linear(spec.hidden_size, 2 * size, spec.mlp_bias, dtype, invariant)
        self.down_proj = Linear(size, spec.hidden_size, spec.mlp_bias, dtype, invariant)
        self.down_proj.reduce = tp if tp.parallel and reduce else None
        self.kernels: LayerKernels | None = None  # the fused activation when set

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
        tp: TPGroup,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype)
        self.self_attn = Attention(spec, dtype, backend, invariant, tp)
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
        tp: TPGroup,
    ) -> None:
        super().__init__()
        embed_dtype = head_dtype if spec.tie_word_embeddings else dtype
        vocab = vocab_rows(spec.vocab_size, tp)[2]
        self.embed_tokens = nn.Parameter(
            torch.empty(vocab, spec.hidden_size, dtype=embed_dtype), False
        )
        self.layers = nn.ModuleList(
            DecoderLayer(spec, dtype, backend, invariant, make_mlp(i), tp)
            for i in range(spec.num_layers)
        )
        self.tp, self.vocab_size = tp, spec.vocab_size
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, head_dtype)
        self.rotary = RotaryEmbedding(spec.head_dim, spec.max_positions, spec.rope)
        self.dtype = dtype

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        images: ImageEmbeds | None = None,
    ) -> torch.Tensor:
        """`images`: rows whose token embeddings an image's take the place of (and whose
        stream takes deepstack features after the first layers); `positions` may then be
        [3, rows] (M-RoPE)."""
        x = vocab_embedding(input_ids, self.embed_tokens, self.vocab_size, self.tp).to(self.dtype)
        if images is not None:
            x = x.index_copy(0, images.rows, images.values.to(x.dtype))
        rope = self.rotary(positions, x.dtype)
        residual = None
        for i, layer in enumerate(self.layers):
            x, residual = layer(rope, x, residual, meta)
            if images is not None and i < len(images.deepstack):
                # the stream is x + residual (summed in the next norm): added to x
                x = x.index_add(0, images.rows, images.deepstack[i].to(x.dtype))
        return self.norm(x, residual)[0] if residual is not None else self.norm(x)


@dataclass
class ImageEmbeds:
    """Image rows of a step: their embeddings, and per early layer the vision tower's
    deepstack features added to their stream after it (Qwen3-VL; none for Qwen2.5-VL)."""

    rows: torch.Tensor
    values: torch.Tensor
    deepstack: list[torch.Tensor] = field(default_factory=list)

    @classmethod
    def of(cls, rows: torch.Tensor, packed: torch.Tensor, hidden: int) -> ImageEmbeds:
        """From rows' packed embeddings [rows, hidden * (1 + deepstack layers)]."""
        parts = list(packed.split(hidden, dim=-1))
        return cls(rows, parts[0], parts[1:])
