"""lm_head_dtype="float32": the final norm and LM head run in fp32 under a bf16 body.

Checked on a decoder with no layers (embedding -> final norm -> tied head), where the bf16
body is only the rounding of the residual stream: with the fp32 head, the engine's logits
must equal transformers' fp32 model fed the bf16-rounded embeddings, to fp32 precision,
and be closer to the plain fp32 logits than the all-bf16 engine's.
"""

from __future__ import annotations

import pytest
import torch

from hotswap import LLM, SamplingParams
from tests.helpers.recording import record_logits

PROMPTS = [list(range(5 + i, 40 + 2 * i)) for i in range(6)]


@pytest.fixture(scope="module")
def head_only_model(tiny_model_factory):  # noqa: ANN201
    return tiny_model_factory(
        "llama", tie_word_embeddings=True, num_hidden_layers=0, hidden_size=256
    )


def engine_logits(model_dir, **engine_args) -> tuple[torch.Tensor, LLM]:  # noqa: ANN001
    llm = LLM(str(model_dir), progress=False, num_kv_blocks=64, **engine_args)
    recorder = record_logits(llm)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    return torch.stack([recorder.logits[o.request_id][0] for o in outs]), llm


def test_fp32_head_reads_the_unrounded_norm_output(head_only_model) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(head_only_model, dtype=torch.float32).eval()
    embed = model.get_input_embeddings().weight
    with torch.no_grad():
        fp32 = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in PROMPTS])
        rounded = [embed[p].bfloat16().float()[None] for p in PROMPTS]
        bf16_stream = torch.stack([model(inputs_embeds=e).logits[0, -1] for e in rounded])
    plain, _ = engine_logits(head_only_model, dtype="bfloat16")
    mixed, llm = engine_logits(head_only_model, dtype="bfloat16", lm_head_dtype="float32")
    torch.testing.assert_close(mixed, bf16_stream, atol=1e-5, rtol=0)
    assert (mixed - fp32).abs().mean() < 0.7 * (plain - fp32).abs().mean()
    params = llm.engine.runner.model.parameter_index()
    assert params["model.norm.weight"].dtype == torch.float32
    assert params["model.embed_tokens"].dtype == torch.float32  # tied: the head's weight


def test_untied_head_is_fp32_and_the_body_stays_bf16(tiny_llama) -> None:
    llm = LLM(str(tiny_llama), progress=False, dtype="bfloat16", lm_head_dtype="float32")
    params = llm.engine.runner.model.parameter_index()
    assert params["lm_head"].dtype == torch.float32
    assert params["model.embed_tokens"].dtype == torch.bfloat16
    assert params["model.layers.0.self_attn.qkv_proj.weight"].dtype == torch.bfloat16
    (out,) = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4


def test_lm_head_dtype_is_validated(tiny_llama) -> None:
    with pytest.raises(ValueError, match="lm_head_dtype"):
        LLM(str(tiny_llama), lm_head_dtype="float16", progress=False)
