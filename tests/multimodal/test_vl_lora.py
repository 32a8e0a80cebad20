"""LoRA on a vision-language model's language model, against peft on transformers' model
with the same image; adapters on the vision tower are refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from hotswap import LLM, SamplingParams
from hotswap.errors import InvalidArgument
from hotswap.lora.request import LoRARequest
from hotswap.multimodal.images import ImageProcessorConfig, process_image
from tests.helpers.tiny_vl import IMAGE, write_tiny_vl_model

pytestmark = pytest.mark.slow
LANGUAGE = r".*language_model.*\.(q_proj|v_proj|gate_proj|down_proj)"


def _adapter(model, out_dir: Path, targets):  # noqa: ANN001, ANN202
    import peft

    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0,
                             init_lora_weights=False)  # fmt: skip
    peft_model = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.25)
    peft_model.save_pretrained(out_dir, safe_serialization=True)
    return peft_model.eval()


def test_language_model_adapter_equals_peft(tmp_path: Path) -> None:
    import transformers

    model_dir = write_tiny_vl_model(tmp_path / "model")
    base = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32
    )
    reference = _adapter(base, tmp_path / "lora", LANGUAGE)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (90, 120, 3), np.uint8))
    prompt = {"prompt": f"<|im_start|>user\nThe quick {IMAGE} jumps<|im_end|>\n"
              "<|im_start|>assistant\n", "multi_modal_data": {"image": [image]}}  # fmt: skip
    llm = LLM(str(model_dir), dtype="float32", enable_lora=True, max_lora_rank=8)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    lora = LoRARequest("lm", 1, str(tmp_path / "lora"))
    out = llm.generate([prompt], params, lora_request=lora, use_tqdm=False)[0]
    plain = llm.generate([prompt], params, use_tqdm=False)[0]
    processed = process_image(image, ImageProcessorConfig.from_model_dir(model_dir))
    ids = torch.tensor([out.prompt_token_ids])
    expected = reference.generate(
        input_ids=ids, pixel_values=torch.from_numpy(processed.pixel_values.copy()),
        image_grid_thw=torch.tensor([processed.grid_thw]), max_new_tokens=10, do_sample=False,
        mm_token_type_ids=(ids == base.config.image_token_id).int(),
    )[0, ids.shape[1] :].tolist()  # fmt: skip
    assert list(out.outputs[0].token_ids) == expected
    assert plain.outputs[0].token_ids != out.outputs[0].token_ids
    # an adapter on the vision tower's layers is refused, naming the path
    fresh = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32
    )
    _adapter(fresh, tmp_path / "vision", r".*visual.*\.gate_proj")
    with pytest.raises(InvalidArgument, match="vision tower") as e:
        llm.generate([prompt], params, use_tqdm=False,
                     lora_request=LoRARequest("v", 2, str(tmp_path / "vision")))  # fmt: skip
    assert e.value.field == "lora_path"
