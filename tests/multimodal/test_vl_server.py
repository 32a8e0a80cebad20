"""A vision-language model behind a real server: chat `image_url` parts (data URLs, local
files), /inference/v1/generate with the trainer's token ids and `content_parts`, the
render route against transformers' processor, and refusals naming the field."""

from __future__ import annotations

import base64
import io
import json
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from tests.helpers.server import RemoteServer
from tests.helpers.tiny_vl import IMAGE, write_tiny_vl_model

pytestmark = pytest.mark.slow


def _png(seed: int, size: tuple[int, int]) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _data_url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201
    root = tmp_path_factory.mktemp("vl_server")
    model_dir = write_tiny_vl_model(root / "model")
    media = root / "media"
    media.mkdir()
    (media / "a.png").write_bytes(_png(0, (90, 120)))
    (root / "outside.png").write_bytes(_png(1, (90, 120)))
    server = RemoteServer(model_dir, "--dtype", "float32", "--allowed-local-media-path",
                          str(media), "--limit-mm-per-prompt", '{"image": 2}')  # fmt: skip
    try:
        yield SimpleNamespace(server=server, model_dir=model_dir, media=media, root=root)
    finally:
        server.stop()


def _messages(*urls: str) -> list[dict]:
    parts = [{"type": "text", "text": "The quick brown fox"}]
    parts += [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": parts + [{"type": "text", "text": "jumps over"}]}]


def _chat(served, *urls: str) -> dict:  # noqa: ANN001
    client = openai.OpenAI(base_url=f"{served.server.url}/v1", api_key="x")
    reply = client.chat.completions.create(
        model=str(served.model_dir), messages=_messages(*urls), max_tokens=8, temperature=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    return reply.model_dump()


def test_chat_images_by_data_url_and_file_give_the_generate_routes_tokens(served) -> None:  # noqa: ANN001
    png = (served.media / "a.png").read_bytes()
    by_data = _chat(served, _data_url(png))
    by_file = _chat(served, f"file://{served.media / 'a.png'}")
    tokens = by_data["choices"][0]["token_ids"]
    assert by_file["choices"][0]["token_ids"] == tokens
    assert by_file["prompt_token_ids"] == by_data["prompt_token_ids"]
    other = _chat(served, _data_url(_png(7, (90, 120))))
    assert other["choices"][0]["token_ids"] != tokens  # the image is read
    # the trainer's own ids, placeholder unexpanded or expanded, and the image as a part
    rendered = httpx.post(f"{served.server.url}/v1/chat/completions/render",
                          json={"model": str(served.model_dir),
                                "messages": _messages(_data_url(png))}).json()  # fmt: skip
    assert rendered["token_ids"] == by_data["prompt_token_ids"]
    tokenized = httpx.post(f"{served.server.url}/tokenize",
                           json={"messages": _messages(_data_url(png))}).json()  # fmt: skip
    assert tokenized["tokens"] == rendered["token_ids"]  # vLLM's /tokenize expands images too
    image_id = json.loads((served.model_dir / "config.json").read_text())["image_token_id"]
    placeholder = rendered["features"]["mm_placeholders"]["image"][0]
    first = rendered["token_ids"].index(image_id)
    unexpanded = (
        rendered["token_ids"][: first + 1] + rendered["token_ids"][first + placeholder["length"] :]
    )
    for ids in (unexpanded, rendered["token_ids"]):
        body = {"token_ids": ids, "return_token_ids": True,
                "sampling_params": {"max_tokens": 8, "temperature": 0},
                "content_parts": [{"type": "image_url", "url": _data_url(png)}]}  # fmt: skip
        out = httpx.post(f"{served.server.url}/inference/v1/generate", json=body).json()
        assert out["choices"][0]["token_ids"] == tokens
        assert out["prompt_token_ids"] == rendered["token_ids"]
        assert out["mm_placeholders"] == rendered["features"]["mm_placeholders"]


def test_render_equals_the_transformers_processor(served) -> None:  # noqa: ANN001
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_5_vl.processing_qwen2_5_vl import Qwen2_5_VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    pngs = [_png(2, (60, 200)), _png(3, (150, 70))]
    rendered = httpx.post(f"{served.server.url}/v1/chat/completions/render",
                          json={"model": str(served.model_dir),
                                "messages": _messages(*map(_data_url, pngs))}).json()  # fmt: skip
    settings = json.loads((served.model_dir / "preprocessor_config.json").read_text())
    settings.pop("image_processor_type")
    images = Qwen2VLImageProcessorPil(**settings)([Image.open(io.BytesIO(p)) for p in pngs])
    # the combined processor needs torchvision for its video half: its image expansion alone
    processor = SimpleNamespace(image_processor=SimpleNamespace(merge_size=2),
                                image_token="<|image_pad|>")  # fmt: skip
    text = "<|im_start|>user\nThe quick brown fox" + IMAGE * 2 + "jumps over<|im_end|>\n"
    text += "<|im_start|>assistant\n"
    pieces = text.split("<|image_pad|>")
    expansions = [Qwen2_5_VLProcessor.replace_image_token(processor, images, i) for i in range(2)]
    text = pieces[0] + "".join(e + piece for e, piece in zip(expansions, pieces[1:]))
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(served.model_dir / "tokenizer.json"))
    assert rendered["token_ids"] == tokenizer(text)["input_ids"]
    image_id = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    ids = np.array(rendered["token_ids"])
    starts = [
        i for i in range(len(ids)) if ids[i] == image_id and (i == 0 or ids[i - 1] != image_id)
    ]
    lengths = [int(g.prod()) // 4 for g in images["image_grid_thw"]]
    expected = [{"offset": s, "length": n} for s, n in zip(starts, lengths)]
    assert rendered["features"]["mm_placeholders"]["image"] == expected


@pytest.mark.parametrize(
    "url,field",
    [
        ("data:image/png;base64,bm90IGFuIGltYWdl", "messages[0].content[1].image_url"),
        ("file:///etc/hostname", "messages[0].content[1].image_url"),
        ("http://example.com/cat.png", "messages[0].content[1].image_url"),
    ],
)
def test_bad_images_are_400_naming_the_part(served, url: str, field: str) -> None:  # noqa: ANN001
    body = {"model": str(served.model_dir), "messages": _messages(url), "max_tokens": 4}
    reply = httpx.post(f"{served.server.url}/v1/chat/completions", json=body)
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == f"body.{field}"


def test_too_many_images_and_truncated_ones_are_400(served) -> None:  # noqa: ANN001
    png = _png(4, (90, 90))
    url = served.server.url
    body = {"model": str(served.model_dir), "messages": _messages(*[_data_url(png)] * 3)}
    reply = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "body.messages"
    body["messages"] = _messages(_data_url(png[: len(png) // 2]))
    reply = httpx.post(f"{url}/v1/chat/completions", json=body)
    assert reply.status_code == 400
    # the server still serves
    assert _chat(served, _data_url(png))["choices"][0]["token_ids"]


def test_a_requests_mm_processor_kwargs_bound_the_image(served) -> None:  # noqa: ANN001
    png = _png(5, (224, 224))
    body = {"model": str(served.model_dir), "messages": _messages(_data_url(png))}
    url = f"{served.server.url}/v1/chat/completions/render"
    full = httpx.post(url, json=body).json()
    small = httpx.post(url, json={**body, "mm_processor_kwargs": {"max_pixels": 56 * 56}}).json()
    sizes = [r["features"]["mm_placeholders"]["image"][0]["length"] for r in (full, small)]
    assert sizes[1] < sizes[0]
    bad = httpx.post(url, json={**body, "mm_processor_kwargs": {"max_pixels": -1}})
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "body.mm_processor_kwargs.max_pixels"


def test_sglangs_image_data_gives_the_chat_routes_tokens(served) -> None:  # noqa: ANN001
    """SGLang's /generate with `image_data` (as slime and verl send it): bare base64 or a
    file path, the placeholder unexpanded in input_ids."""
    png = (served.media / "a.png").read_bytes()
    chat = _chat(served, _data_url(png))
    image_id = json.loads((served.model_dir / "config.json").read_text())["image_token_id"]
    ids = chat["prompt_token_ids"]
    first, last = ids.index(image_id), len(ids) - ids[::-1].index(image_id)
    unexpanded = ids[: first + 1] + ids[last:]
    params = {"max_new_tokens": 8, "temperature": 0}
    url = f"{served.server.url}/generate"
    for image in (base64.b64encode(png).decode(), str(served.media / "a.png")):
        body = {"input_ids": unexpanded, "image_data": [image], "sampling_params": params}
        reply = httpx.post(url, json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["output_ids"] == chat["choices"][0]["token_ids"]
    outside = {"input_ids": unexpanded, "image_data": str(served.root / "outside.png"),
               "sampling_params": params}  # fmt: skip
    refused = httpx.post(url, json=outside, timeout=60)
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "body.image_data[0]"
