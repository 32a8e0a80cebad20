"""Vision-language throughput: a Qwen2.5-VL-shaped model with random weights, hotswap
against transformers, one image per prompt at two resolutions, and the vision encoder's
share of the time.

The model (written once, bf16): a Qwen2.5-0.5B-shaped decoder (hidden 896, 24 layers, 14
query / 2 KV heads, intermediate 4864) and a reduced vision tower (depth 8, hidden 640, 10
heads, windows of 112 pixels, full attention in blocks 3 and 7; the real one is depth 32,
hidden 1280), the built-in model's tokenizer with Qwen's vision tokens added. The workload:
`--prompts` requests, each a distinct random image (224x224: 64 image tokens; 448x448: 256)
and 16 text tokens, 32 output tokens greedy with EOS ignored. Wall time covers everything
from the PIL image on: preprocessing, the tower, prefill and decode.

transformers runs `generate` on the same batch (every prompt the same length: no padding),
its images through its own `Qwen2VLImageProcessorPil`. vLLM's CPU build is not measured:
its Qwen2.5-VL processor imports torchvision, and no CPU torchvision for its torch is
installable here (`--with-vllm` tries and says why).

    python benchmarks/multimodal.py [--prompts 16] [--repeats 2] [--with-vllm]
                                    [--out benchmarks/results/multimodal-....json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import torch
from PIL import Image

IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
RESOLUTIONS = ((224, 224), (448, 448))
OUTPUT_TOKENS = 32
PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 56 * 56,
                "max_pixels": 28 * 28 * 1280, "patch_size": 14, "temporal_patch_size": 2,
                "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711]}  # fmt: skip


def write_model(root: Path) -> Path:
    """The random checkpoint, the built-in tokenizer plus the vision tokens."""
    import transformers
    from tokenizers import AddedToken, Tokenizer

    from hotswap.config import resolve_model_path

    out = root / "qwen2.5-vl-bench"
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer.from_file(str(resolve_model_path(None) / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in VISION_TOKENS])
    tokenizer.save(str(out / "tokenizer.json"))
    config_file = resolve_model_path(None) / "tokenizer_config.json"
    (out / "tokenizer_config.json").write_text(config_file.read_text())
    ids = {t: tokenizer.token_to_id(t) for t in VISION_TOKENS}
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=tokenizer.get_vocab_size(), hidden_size=896,
                         intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, max_position_embeddings=4096,
                         rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]},
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=True),
        vision_config=dict(depth=8, hidden_size=640, intermediate_size=1712, num_heads=10,
                           out_hidden_size=896, window_size=112, fullatt_block_indexes=[3, 7]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
    return out


def workload(count: int, size: tuple[int, int]) -> tuple[list[str], list[Image.Image]]:
    rng = np.random.default_rng(size[0])
    images = [Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8))
              for _ in range(count)]  # fmt: skip
    text = "<|im_start|>user\n" + IMAGE + " Describe the picture in one short line.<|im_end|>\n"
    return [text + "<|im_start|>assistant\n"] * count, images


def hotswap_run(llm, prompts: list[str], images: list[Image.Image]) -> dict[str, float]:  # noqa: ANN001
    """Output tok/s and the tower's share of the wall time."""
    from hotswap import SamplingParams

    model = llm.engine.runner.model
    encode, spent = model.encode_images, [0.0]

    def timed(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        start = time.perf_counter()
        out = encode(*args, **kwargs)
        spent[0] += time.perf_counter() - start
        return out

    model.encode_images = timed
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    llm.reset_prefix_cache()
    llm.engine.runner.images.clear()
    batch = [{"prompt": p, "multi_modal_data": {"image": i}} for p, i in zip(prompts, images)]
    start = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    model.encode_images = encode
    assert sum(len(o.outputs[0].token_ids) for o in outs) == len(prompts) * OUTPUT_TOKENS
    return {"tok_s": len(prompts) * OUTPUT_TOKENS / elapsed, "encoder_share": spent[0] / elapsed}


def transformers_run(
    model,  # noqa: ANN001
    model_dir: Path,
    prompts: list[str],
    images: list[Image.Image],
) -> float:
    """transformers' generate over the batch, its own image processor included."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    settings = {k: v for k, v in PREPROCESSOR.items() if k != "image_processor_type"}
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(model_dir / "tokenizer.json"))
    image_id = model.config.image_token_id
    start = time.perf_counter()
    pixels = Qwen2VLImageProcessorPil(**settings)(images, return_tensors="pt")
    tokens = int(pixels["image_grid_thw"][0].prod()) // 4
    text = [p.replace("<|image_pad|>", "<|image_pad|>" * tokens) for p in prompts]
    ids = torch.tensor(tokenizer(text)["input_ids"])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=OUTPUT_TOKENS, min_new_tokens=OUTPUT_TOKENS,
                             pixel_values=pixels["pixel_values"].to(torch.bfloat16),
                             image_grid_thw=pixels["image_grid_thw"],
                             mm_token_type_ids=(ids == image_id).int(), pad_token_id=0)  # fmt: skip
    elapsed = time.perf_counter() - start
    assert out.shape[1] - ids.shape[1] == OUTPUT_TOKENS
    return len(prompts) * OUTPUT_TOKENS / elapsed


def try_vllm(venv: Path, model_dir: Path) -> str:
    """Whether vLLM's CPU build loads the model; its error when it does not."""
    script = (f"from vllm import LLM\nLLM(model={str(model_dir)!r}, dtype='bfloat16', "
              "max_model_len=4096)\nprint('LOADED')\n")  # fmt: skip
    done = subprocess.run([str(venv / "bin" / "python"), "-c", script], capture_output=True,
                          text=True, timeout=1800,
                          env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="4"))  # fmt: skip
    if "LOADED" in done.stdout:
        return "loads (throughput not measured by this script yet)"
    lines = (done.stdout + done.stderr).splitlines()  # vLLM logs its errors to stdout
    # the root cause (a module its processor imports) before pydantic's summary of it
    errors = [line for line in lines if "ModuleNotFoundError" in line] or [
        line for line in lines if "Error" in line
    ]
    return "does not serve it: " + (errors[-1].strip() if errors else "no error line")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--with-vllm", action="store_true")
    parser.add_argument("--vllm-venv", default=str(Path(__file__).parent.parent / ".venv-vllm"))
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    import transformers

    from hotswap import LLM
    from hotswap.default_model import cache_root

    model_dir = write_model(cache_root() / "bench-models")
    llm = LLM(str(model_dir), dtype="bfloat16", progress=False, max_num_seqs=256,
              max_num_batched_tokens=4096)  # fmt: skip
    reference = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.bfloat16
    ).eval()
    results = {}
    for size in RESOLUTIONS:
        prompts, images = workload(args.prompts, size)
        hotswap_run(llm, prompts[:2], images[:2])  # warm-up
        runs = [hotswap_run(llm, prompts, images) for _ in range(args.repeats)]
        best = max(runs, key=lambda r: r["tok_s"])
        ours = transformers_run(reference, model_dir, prompts[:2], images[:2])  # warm-up
        ours = max(transformers_run(reference, model_dir, prompts, images)
                   for _ in range(args.repeats))  # fmt: skip
        results[f"{size[0]}x{size[1]}"] = {**best, "transformers_tok_s": ours}
    vllm = try_vllm(Path(args.vllm_venv), model_dir) if args.with_vllm else "not tried"
    print(f"\nQwen2.5-VL shape (reduced tower), bf16, {args.prompts} prompts x 1 image, "
          f"{OUTPUT_TOKENS} output tokens, best of {args.repeats}")  # fmt: skip
    print("| image | hotswap tok/s | transformers tok/s | ratio | encoder share |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        ratio = r["tok_s"] / r["transformers_tok_s"]
        print(f"| {name} | {r['tok_s']:.1f} | {r['transformers_tok_s']:.1f} | {ratio:.2f}x | "
              f"{r['encoder_share']:.0%} |")  # fmt: skip
    print(f"vLLM's CPU build: {vllm}")
    if args.out:
        record = dict(results=results, vllm=vllm, prompts=args.prompts,
                      date=time.strftime("%Y-%m-%d"))  # fmt: skip
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
