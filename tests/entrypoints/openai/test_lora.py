"""LoRA adapters over HTTP end to end: vLLM's /v1/load_lora_adapter and
/v1/unload_lora_adapter, `model=<adapter>` on the OpenAI routes, /v1/models, --lora-modules
and SGLang's /load_lora_adapter with /generate's `lora_path`, against one real server
(float32, so greedy tokens and logprobs match peft's float32 forward)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import torch

from tests.helpers.server import RemoteServer
from tests.helpers.tiny_models import peft_reference, write_peft_adapter

# Every test here talks to the one server of this module: slow.
pytestmark = pytest.mark.slow

MODEL = "tiny"
PROMPT = [5, 17, 33, 80, 101, 7, 9, 41, 12, 250, 3, 77, 64, 18, 90, 23, 45, 8, 150, 31]
MESSAGES = [{"role": "user", "content": "Swap the adapter, keep the base."}]
EXTRA = {"ignore_eos": True, "return_token_ids": True}
GREEDY = {"temperature": 0.0, "max_tokens": 6, "extra_body": EXTRA}
MLP = ("gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Beside the model (the default --allowed-weight-dirs is the model's parent)."""
    root = tmp_path_factory.mktemp("http-adapters")
    paths = {
        "a": write_peft_adapter(tiny_llama, root / "a", 8, seed=1),
        "b": write_peft_adapter(tiny_llama, root / "b", 16, ("q_proj", "v_proj") + MLP, seed=2),
        "rank128": write_peft_adapter(tiny_llama, root / "rank128", 128, ("q_proj",), seed=3),
    }
    broken = shutil.copytree(paths["a"], root / "no-config")
    (broken / "adapter_config.json").unlink()
    return {**paths, "no-config": broken}


@pytest.fixture(scope="module")
def server(tiny_llama: Path, adapters: dict[str, Path]) -> Iterator[RemoteServer]:
    args = ("--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "512",
            "--num-kv-blocks", "128", "--log-level", "warning")  # fmt: skip
    lora = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "64",
            "--lora-modules", f"static={adapters['b']}")  # fmt: skip
    with RemoteServer(tiny_llama, *args, *lora) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server: RemoteServer) -> Iterator[httpx.Client]:
    with server.client() as client:
        yield client


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return server.openai()


def load(http: httpx.Client, name: str, path: Path, **extra: object) -> httpx.Response:
    return http.post("/v1/load_lora_adapter",
                     json={"lora_name": name, "lora_path": str(path), **extra})  # fmt: skip


def models(client: openai.OpenAI) -> dict[str, dict]:
    return {card.id: card.model_dump() for card in client.models.list().data}


def greedy(client: openai.OpenAI, model: str) -> tuple[list[int], list[float]]:
    out = client.completions.create(model=model, prompt=PROMPT, logprobs=0, **GREEDY)
    assert out.model == model  # vLLM echoes the adapter's name
    choice = out.choices[0]
    return choice.model_extra["token_ids"], choice.logprobs.token_logprobs


def sglang_greedy(item: dict) -> tuple[list[int], list[float]]:
    entries = item["meta_info"]["output_token_logprobs"]
    assert item["output_ids"] == [token for _, token, _ in entries]
    return item["output_ids"], [logprob for logprob, _, _ in entries]


def peft_logprobs(model_dir: Path, adapter: Path | None, prompt: list[int], tokens: list[int]):
    """peft's float32 logprobs of `tokens` after `prompt`, and its greedy choices."""
    model = peft_reference(model_dir, adapter)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    logprobs = torch.log_softmax(logits.float(), -1)
    return logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0], logits.argmax(-1).tolist()


def assert_error(response: httpx.Response, status: int, param: str, message: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and message in error["message"], error


def test_load_answers_vllm_text_and_models_lists_adapters(http, client, adapters) -> None:
    response = load(http, "alpha", adapters["a"])
    assert response.status_code == 200, response.text
    assert response.text == "Success: LoRA adapter 'alpha' added successfully."
    cards = models(client)
    assert list(cards)[0] == MODEL and {"alpha", "static"} <= set(cards)
    assert (cards["alpha"]["root"], cards["alpha"]["parent"]) == (str(adapters["a"]), MODEL)
    assert (cards["static"]["root"], cards["static"]["parent"]) == (str(adapters["b"]), MODEL)
    assert_error(load(http, "alpha", adapters["b"]), 400, "body.lora_name",
                 "The lora adapter 'alpha' has already been loaded.")  # fmt: skip
    missing = http.post("/v1/load_lora_adapter", json={"lora_name": "x"})
    assert_error(missing, 400, "body.lora_path", "Both 'lora_name' and 'lora_path' must be")
    # vLLM's flag for 3-D (stacked-expert) adapters: accepted (the layout is read from the
    # adapter), here on a dense one
    flagged = load(http, "flagged", adapters["a"], is_3d_lora_weight=True)
    assert flagged.status_code == 200, flagged.text
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "flagged"}).status_code == 200
    nul = load(http, "x", Path(f"{adapters['a']}\x00"))
    assert_error(nul, 400, "body.lora_path", "lora_path: must not contain a NUL character")


def test_completion_on_adapter_equals_peft(http, client, tiny_llama, adapters) -> None:
    tokens, logprobs = greedy(client, "static")  # loaded by --lora-modules
    expected, argmax = peft_logprobs(tiny_llama, adapters["b"], PROMPT, tokens)
    assert argmax == tokens
    assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-4), (logprobs, expected)
    base_tokens, base_logprobs = greedy(client, MODEL)
    assert base_tokens != tokens or max(abs(x - y) for x, y in zip(base_logprobs, logprobs)) > 1e-3
    # vLLM's token-in/token-out route takes the adapter as `model` too
    body = {"model": "static", "token_ids": PROMPT,
            "sampling_params": {"max_tokens": 6, "temperature": 0, "ignore_eos": True}}  # fmt: skip
    out = http.post("/inference/v1/generate", json=body)
    assert out.status_code == 200, out.text
    assert out.json()["model"] == "static"
    assert out.json()["choices"][0]["token_ids"] == tokens


def test_chat_on_adapter_equals_peft(client, tiny_llama, adapters) -> None:
    out = client.chat.completions.create(model="static", messages=MESSAGES, logprobs=True,
                                         **GREEDY)  # fmt: skip
    assert out.model == "static"
    choice = out.choices[0]
    tokens, prompt = choice.model_extra["token_ids"], out.model_extra["prompt_token_ids"]
    expected, argmax = peft_logprobs(tiny_llama, adapters["b"], prompt, tokens)
    assert argmax == tokens
    got = torch.tensor([entry.logprob for entry in choice.logprobs.content])
    assert torch.allclose(got, expected, atol=1e-4), (got, expected)


def test_reload_in_place_unload_then_404(http, client, adapters) -> None:
    assert load(http, "swap", adapters["a"]).status_code == 200
    before = greedy(client, "swap")
    assert before == greedy(client, "alpha")  # the same adapter under another name
    assert load(http, "swap", adapters["b"], load_inplace=True).status_code == 200
    after = greedy(client, "swap")
    assert after[0] != before[0]  # adapter b now, as "static" serves it:
    static = greedy(client, "static")  # (float32 rounding differs with the batch shape,
    assert after[0] == static[0]  # e.g. a prefix-cache hit: logprobs to 1e-5)
    assert max(abs(a - b) for a, b in zip(after[1], static[1], strict=True)) < 1e-5
    response = http.post("/v1/unload_lora_adapter", json={"lora_name": "swap"})
    assert response.status_code == 200, response.text
    assert response.text == "Success: LoRA adapter 'swap' removed successfully."
    with pytest.raises(openai.NotFoundError, match="The model `swap` does not exist."):
        client.completions.create(model="swap", prompt=PROMPT, max_tokens=1)
    again = http.post("/v1/unload_lora_adapter", json={"lora_name": "swap"})
    assert_error(again, 404, "body.lora_name", "The lora adapter 'swap' cannot be found.")
    assert "swap" not in models(client)


def test_spans_name_the_adapter_and_its_version_on_every_route(http, client, adapters) -> None:
    assert load(http, "prov", adapters["a"]).status_code == 200
    assert load(http, "prov", adapters["b"], load_inplace=True).status_code == 200  # version 2
    spans = client.completions.create(model="prov", prompt=PROMPT, **GREEDY).choices[0]
    assert [(s["lora_name"], s["lora_version"]) for s in spans.model_extra["weight_versions"]] \
        == [("prov", 2)]  # fmt: skip
    chat = client.chat.completions.create(model="prov", messages=MESSAGES, **GREEDY)
    assert chat.choices[0].model_extra["weight_versions"][0]["lora_version"] == 2
    body = {"model": "prov", "token_ids": PROMPT, "sampling_params": {"max_tokens": 2}}
    generated = http.post("/inference/v1/generate", json=body).json()["choices"][0]
    assert generated["weight_versions"][0]["lora_name"] == "prov"
    sglang = http.post(
        "/generate",
        json={"input_ids": PROMPT, "lora_path": "prov", "sampling_params": {"max_new_tokens": 2}},
    ).json()
    assert sglang["meta_info"]["weight_versions"][0]["lora_version"] == 2
    base = client.completions.create(model=MODEL, prompt=PROMPT, **GREEDY).choices[0]
    assert "lora_name" not in base.model_extra["weight_versions"][0]  # the base model's
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "prov"}).status_code == 200


@pytest.mark.parametrize(("adapter", "message"), [
    ("no-config", "lora_path: no adapter_config.json in it"),
    ("rank128", "r = 128 exceeds --max-lora-rank 64"),
])  # fmt: skip
def test_bad_adapter_is_400_naming_lora_path(http, client, adapters, adapter, message) -> None:
    cards = models(client)
    response = load(http, "bad", adapters[adapter])
    assert_error(response, 400, "body.lora_path", message)
    assert models(client).keys() == cards.keys()


def test_sglang_load_and_generate_with_lora_path(http, client, adapters) -> None:
    body = {"lora_name": "sg", "lora_path": str(adapters["a"])}
    response = http.post("/load_lora_adapter", json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert (answer["success"], answer["error_message"]) == (True, "")
    assert answer["loaded_adapters"]["sg"] == str(adapters["a"])
    sampling = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    body = {"input_ids": [PROMPT, PROMPT], "sampling_params": sampling, "lora_path": [None, "sg"],
            "return_logprob": True}  # fmt: skip
    out = http.post("/generate", json=body)
    assert out.status_code == 200, out.text
    base, on_adapter = (sglang_greedy(item) for item in out.json())
    assert base != on_adapter
    for got, model in ((base, MODEL), (on_adapter, "alpha")):  # alpha: the same adapter
        tokens, logprobs = greedy(client, model)
        assert got[0] == tokens and torch.allclose(torch.tensor(got[1]), torch.tensor(logprobs))
    unknown = http.post("/generate", json={"input_ids": PROMPT, "lora_path": "nope"})
    assert_error(unknown, 400, "body.lora_path", "no LoRA adapter named 'nope'")
    done = http.post("/unload_lora_adapter", json={"lora_name": "sg"})
    assert done.status_code == 200 and done.json()["success"] is True
    assert "sg" not in done.json()["loaded_adapters"]
    gone = http.post("/unload_lora_adapter", json={"lora_name": "sg"})
    assert gone.status_code == 404 and gone.json()["success"] is False


def test_lora_module_that_fails_to_load_stops_the_server(tiny_llama: Path, tmp_path) -> None:
    command = [sys.executable, "-m", "hotswap", "serve", str(tiny_llama), "--port", "0",
               "--enable-lora", "--lora-modules", f"bad={tmp_path / 'missing'}",
               "--num-kv-blocks", "16", "--max-model-len", "256"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 2, result.stderr
    assert "hotswap: error: --lora-modules: cannot load 'bad'" in result.stderr
    assert "lora_path: " in result.stderr and "Traceback" not in result.stderr
