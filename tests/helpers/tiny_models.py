"""Tiny random Hugging Face-format models (config.json + safetensors + tokenizer.json),
written with transformers so the same directory is the parity reference."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CORPUS = (
    "The quick brown fox jumps over the lazy dog. Reinforcement learning trains a policy "
    "while it keeps generating rollouts. Paged attention stores keys and values in blocks. "
    "Numbers 0123456789 and symbols !?.,;:()[]{} appear too. "
    "Pause, swap the weights, resume: no request is lost. 你好世界，強化學習。 🙂🚀 "
) * 20

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_tokenizer(
    out_dir: Path, vocab_size: int = 384, extra_special: tuple[str, ...] = (),
    chat_template: str = CHATML,
) -> None:  # fmt: skip
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS + list(extra_special),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([CORPUS], trainer)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "chat_template": chat_template,
        "model_max_length": 512,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config))


def _hf_config(arch: str, vocab_size: int, **overrides):  # noqa: ANN202
    import transformers

    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=False,
        initializer_range=0.1,
    )
    common.update(MOE_DEFAULTS.get(arch, {}))
    common.update(overrides)
    cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "qwen3_moe": transformers.Qwen3MoeConfig,
        "qwen2_moe": transformers.Qwen2MoeConfig,
        "mixtral": transformers.MixtralConfig,
        "olmoe": transformers.OlmoeConfig,
    }[arch]
    if arch in ("qwen3", "qwen3_moe"):
        common.setdefault("head_dim", 16)
    return cls(**common)


# 8 experts, top-2, per architecture: Qwen3-MoE renormalises the top-k and keeps its
# middle layer dense (mlp_only_layers), Qwen2-MoE has a gated shared expert, OLMoE clamps
# q/k/v (at 3.0, which the tiny models reach); Mixtral always renormalises.
MOE_DEFAULTS: dict[str, dict] = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      norm_topk_prob=True, num_hidden_layers=3, mlp_only_layers=[1]),
    "qwen2_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=32),
    "olmoe": dict(num_experts=8, num_experts_per_tok=2, intermediate_size=32, clip_qkv=3.0),
}  # fmt: skip


def write_tiny_model(out_dir: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """A 2-layer model with peaked logits (large init) so greedy parity is meaningful."""
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out_dir)
    vocab = json.loads((out_dir / "tokenizer.json").read_text())["model"]["vocab"]
    config = _hf_config(arch, len(vocab) + len(SPECIAL_TOKENS) * 0, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if arch == "qwen2":  # make the q/k/v biases matter
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0, 0.1)
    if arch in ("qwen3", "qwen3_moe", "olmoe"):
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def write_peft_adapter(
    model_dir: Path,
    out_dir: Path,
    rank: int = 8,
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj"),
    seed: int = 0,
    alpha: float | None = None,
    use_rslora: bool = False,
    **patterns: dict,  # peft's rank_pattern, alpha_pattern
) -> Path:
    """A random, non-zero LoRA adapter for the model in `model_dir`, written by peft
    itself (adapter_config.json + adapter_model.safetensors)."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(seed)
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha if alpha is not None else 2 * rank,
        target_modules=list(targets),
        use_rslora=use_rslora,
        init_lora_weights=False,  # random A and B: the adapter changes the outputs
        lora_dropout=0.0,
        **patterns,
    )
    peft_model = peft.get_peft_model(model, config)
    with torch.no_grad():  # peft's random init is small; make the adapter matter
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.5 / rank**0.5)
    out_dir.mkdir(parents=True, exist_ok=True)
    peft_model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def peft_reference(model_dir: Path, adapter_dir: Path | None):  # noqa: ANN201
    """The float32 transformers model with the adapter applied by peft (None: the base)."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_dir)
    return model.eval()
