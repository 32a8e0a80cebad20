"""What a decoder model's config.json says about its shape, read once."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hotswap.model.layers import rope_parameters


@dataclass(frozen=True)
class DecoderSpec:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    max_positions: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    rope: dict[str, Any]
    # OLMoE normalises all of q (and of k) as one vector, not per head, and may clamp them
    qk_norm_per_head: bool = True
    clip_qkv: float | None = None

    @classmethod
    def from_hf(
        cls,
        cfg: dict[str, Any],
        *,
        qkv_bias: bool | None = None,
        o_bias: bool | None = None,
        qk_norm: bool = False,
        qk_norm_per_head: bool = True,
    ) -> DecoderSpec:
        try:
            heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            attention_bias = bool(cfg.get("attention_bias", False))
            spec = cls(
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                num_layers=int(cfg["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(cfg.get("head_dim") or hidden // heads),
                intermediate_size=int(cfg["intermediate_size"]),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                max_positions=int(cfg.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
                o_bias=attention_bias if o_bias is None else o_bias,
                mlp_bias=bool(cfg.get("mlp_bias", False)),
                qk_norm=qk_norm,
                rope=rope_parameters(cfg),
                qk_norm_per_head=qk_norm_per_head,
                clip_qkv=None if cfg.get("clip_qkv") is None else float(cfg["clip_qkv"]),
            )
        except KeyError as e:
            raise ValueError(f"config.json: required key {e.args[0]!r} is missing") from None
        if spec.num_heads % spec.num_kv_heads:
            raise ValueError(
                f"config.json: num_attention_heads ({spec.num_heads}) is not a multiple of "
                f"num_key_value_heads ({spec.num_kv_heads})"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"config.json: hidden_act {cfg['hidden_act']!r} is not supported")
        return spec
