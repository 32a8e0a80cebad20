"""Fuzz every route of the server's OpenAPI schema (schemathesis + hypothesis) against a
real `hotswap serve` process: no input may cause a 5xx or a hang.

After each case the server is put back to a running state (wake, resume, weights reloaded
if a level-2 sleep dropped them), so a fuzzed `/pause` or `/sleep` cannot stall the cases
that follow.
"""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error

from tests.helpers.server import RemoteServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fuzz_server(tiny_llama):
    args = (
        "--served-model-name", "tiny", "--dtype", "float32", "--block-size", "8",
        "--max-model-len", "96", "--enable-control", "--enable-sleep-mode",
    )  # fmt: skip
    with RemoteServer(tiny_llama, *args) as srv:
        yield srv


def restore(server: RemoteServer, model_dir: str) -> None:
    with server.client(timeout=30) as http:
        http.post("/wake_up")
        http.post("/resume")
        if 'hotswap:weights_missing{model_name="tiny"} 1.0' in http.get("/metrics").text:
            r = http.post("/update_weights_from_disk", json={"model_path": model_dir})
            assert r.status_code == 200, r.text


# Routes a framework calls that hotswap deliberately does not implement answer 501 (Not
# Implemented: the caller fails loudly instead of carrying on without, e.g., prime-rl's
# broadcaster); every other 5xx is a failure.
NOT_IMPLEMENTED = {"/init_broadcaster", "/areal_set_update_weight_meta_lora",
                   "/areal_update_weights_lora", "/areal_update_weights_lora_xccl"}  # fmt: skip


def not_a_server_error_but_declared_501(ctx, response, case):  # noqa: ANN001, ANN201
    if response.status_code == 501 and case.path in NOT_IMPLEMENTED:
        return None
    return not_a_server_error(ctx, response, case)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_server_errors_and_no_hangs(
    fuzz_server: RemoteServer, tiny_llama, mode: GenerationMode
) -> None:
    # Driven through hypothesis directly: schemathesis' pytest plugin predates pytest 9.
    schema = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")

    @given(case=schema.as_strategy(generation_mode=mode))
    @settings(
        max_examples=150,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    def check(case) -> None:  # noqa: ANN001 - a schemathesis Case
        try:
            case.call_and_validate(
                base_url=fuzz_server.url,
                checks=[not_a_server_error_but_declared_501],
                timeout=30,
            )
        finally:
            restore(fuzz_server, str(tiny_llama))

    check()


def test_server_still_serves_after_fuzzing(fuzz_server: RemoteServer) -> None:
    # Greedy with EOS ignored: sampled at the default temperature, the tiny model's 384-token
    # vocabulary draws EOS as the first token about once in 400 runs (seen in CI).
    body = {"model": "tiny", "prompt": "The quick", "max_tokens": 4}
    body |= {"temperature": 0, "ignore_eos": True}
    r = httpx.post(f"{fuzz_server.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4
