"""A tiny random Qwen2.5-VL (config.json + safetensors + tokenizer + image processor
config), written with transformers so the same directory is the parity reference."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tests.helpers.tiny_models import write_tokenizer

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
# Qwen2-VL's chat template, reduced: a content list's image parts become the placeholder
VL_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] in ('image', 'image_url') or 'image' in part %}"
    "{{ '" + IMAGE + "' }}{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Small images: grids of 4..16 patches a side
PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "min_pixels": 56 * 56,
    "max_pixels": 14 * 14 * 4 * 64,
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
}


# Qwen3-VL's image processor: patches of 16, mean and std 0.5
PREPROCESSOR_QWEN3 = {**PREPROCESSOR, "patch_size": 16, "min_pixels": 64 * 64,
                      "max_pixels": 16 * 16 * 4 * 64, "image_mean": [0.5] * 3,
                      "image_std": [0.5] * 3}  # fmt: skip


def write_tiny_vl_model(out_dir: Path, seed: int = 0, family: str = "qwen2_5_vl") -> Path:
    """`family`: "qwen2_5_vl" or "qwen3_vl" (deepstack from both tower blocks)."""
    import transformers

    out_dir.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out_dir, extra_special=VISION_TOKENS, chat_template=VL_TEMPLATE)
    tok = json.loads((out_dir / "tokenizer.json").read_text())
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    text = dict(vocab_size=len(tok["model"]["vocab"]), hidden_size=64, intermediate_size=128,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=10000.0,
                initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                tie_word_embeddings=False)  # fmt: skip
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=64,
                  spatial_merge_size=2, temporal_patch_size=2, initializer_range=0.1)  # fmt: skip
    tokens = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                  vision_start_token_id=ids["<|vision_start|>"],
                  vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)  # fmt: skip
    if family == "qwen3_vl":
        text.update(head_dim=16, rope_scaling={"rope_type": "default", "mrope_interleaved": True,
                                               "mrope_section": [2, 3, 3]})  # fmt: skip
        vision.update(patch_size=16, num_position_embeddings=64, deepstack_visual_indexes=[0, 1])
        config = transformers.Qwen3VLConfig(text_config=text, vision_config=vision, **tokens)
        model_class, preprocessor = transformers.Qwen3VLForConditionalGeneration, PREPROCESSOR_QWEN3
    else:
        text.update(rope_scaling={"type": "mrope", "mrope_section": [2, 3, 3]})
        vision.update(patch_size=14, window_size=56, fullatt_block_indexes=[1])
        config = transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, **tokens)
        model_class, preprocessor = transformers.Qwen2_5_VLForConditionalGeneration, PREPROCESSOR
    torch.manual_seed(seed)
    model = model_class(config).to(torch.float32)
    with torch.no_grad():  # biases and norms that matter
        for name, param in model.named_parameters():
            norm = "norm" in name or "ln_q" in name
            if name.endswith("bias") or norm:
                param.normal_(1.0 if norm and not name.endswith("bias") else 0.0, 0.1)
    model.save_pretrained(out_dir, safe_serialization=True)
    (out_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor))
    return out_dir
