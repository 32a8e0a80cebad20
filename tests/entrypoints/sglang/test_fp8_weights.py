"""An FP8 server (`--quantization fp8`) taking the weights a trainer quantized itself, over
SGLang's routes as slime and AReaL send them: `/update_weights_from_distributed` (every
tensor its own gloo broadcast; FP8 codes travel as their bytes, gloo having no float8) and
`/update_weights_from_tensor` by value. Either equals a fresh FP8 engine on the trainer's
bf16 weights (digest); codes sent without their scales are refused as a whole."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from tests.entrypoints.sglang.test_weights import (
    alongside,
    broadcast_all,
    by_value,
    join,
    update_payload,
    weights,
)
from tests.helpers.server import RemoteServer
from tests.weight_transfer.test_fp8_rounds import FP8, digest, fp8_llm
from tests.weight_transfer.test_fp8_trainer_quantized import trainer_quantized

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def http(v1_dir: Path) -> Iterator[httpx.Client]:
    args = ("--served-model-name", "tiny", "--dtype", "float32", "--enable-control",
            "--weight-transfer-config", '{"backend": "gloo"}', "--quantization", "fp8",
            "--hf-overrides", json.dumps(FP8["hf_overrides"]),
            "--log-level", "warning")  # fmt: skip
    with RemoteServer(v1_dir, *args) as server, server.client(timeout=120) as client:
        yield client


def test_slime_style_fp8_rounds_equal_a_fresh_fp8_engine(http, v1_dir, v2_dir) -> None:  # noqa: ANN001
    sent = dict(trainer_quantized(load_file(v2_dir / "model.safetensors")))
    want = digest(fp8_llm(v2_dir, None))
    group = join(http, "fp8")
    try:
        # every tensor its own broadcast; codes as their bytes (what a gloo sender can post)
        wire = [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
                for t in sent.values()]  # fmt: skip
        response, _ = alongside(
            lambda: http.post("/update_weights_from_distributed",
                              json=update_payload(sent, "fp8", weight_version="slime")),
            lambda: broadcast_all(group, wire),
        )  # fmt: skip
        assert response.status_code == 200, response.text
        assert weights(http)["digest"] == want
    finally:
        dist.destroy_process_group(group)
    # back to v1, then v2 again by value; codes without their scales change nothing
    v1 = dict(trainer_quantized(load_file(v1_dir / "model.safetensors")))
    payload = {"named_tensors": [by_value(n, t) for n, t in v1.items()], "weight_version": "v1"}
    assert http.post("/update_weights_from_tensor", json=payload).status_code == 200
    before = weights(http)
    assert before["digest"] == digest(fp8_llm(v1_dir, None)) != want
    codes_only = [by_value(n, t) for n, t in sent.items() if not n.endswith("_scale_inv")]
    response = http.post("/update_weights_from_tensor", json={"named_tensors": codes_only})
    assert response.status_code == 400 and "without its scales" in response.text, response.text
    assert weights(http) == before
    payload = {"named_tensors": [by_value(n, t) for n, t in sent.items()], "weight_version": "v2"}
    assert http.post("/update_weights_from_tensor", json=payload).status_code == 200
    assert weights(http)["digest"] == want
