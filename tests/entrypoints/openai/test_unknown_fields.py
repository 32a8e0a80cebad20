"""Request-field tolerance, as vLLM: unknown fields are ignored with a throttled warning
naming them (`--reject-unknown-fields`: 400 naming the field); known parameters hotswap
does not implement stay 400 at non-default values either way."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from hotswap.entrypoints.openai.params import IGNORED_FIELDS_WARNING, warn_ignored_fields
from hotswap.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from hotswap.entrypoints.server.limits import WarningThrottle
from tests.entrypoints.openai.conftest import MODEL

MESSAGES = [{"role": "user", "content": "Tell me about paged attention."}]
# return_token_ids and priority (at its default) are parameters hotswap knows; foo is not.
EXTRA = {"foo": 1, "return_token_ids": True, "priority": 0}
BASE = {"model": MODEL, "temperature": 0.0, "max_tokens": 8, "ignore_eos": True}
ROUTES = {
    "/v1/completions": {**BASE, "prompt": "The quick brown fox"},
    "/v1/chat/completions": {**BASE, "messages": MESSAGES},
    "/tokenize": {"model": MODEL, "prompt": "The quick brown fox"},
    "/detokenize": {"model": MODEL, "tokens": [5, 6, 7]},
}


def _answer(response) -> dict:  # noqa: ANN001 - httpx.Response
    """The response without what differs between any two requests: id, created and the
    prefix-cache hits (the second request finds the first one's blocks)."""
    assert response.status_code == 200, response.text
    answer = {k: v for k, v in response.json().items() if k not in ("id", "created")}
    if isinstance(answer.get("usage"), dict):
        answer["usage"].pop("prompt_tokens_details", None)
    return answer


# -- a real server: the default is to ignore them --------------------------------------------


@pytest.mark.parametrize("path", list(ROUTES))
def test_unknown_fields_are_ignored(http, path: str) -> None:
    known = {k: v for k, v in EXTRA.items() if k != "foo"} if "completions" in path else {}
    plain = _answer(http.post(path, json=ROUTES[path] | known))
    extra = {"foo": 1, "bar": {"nested": [1, 2]}}
    assert _answer(http.post(path, json=ROUTES[path] | known | extra)) == plain
    if "completions" in path:
        assert "token_ids" in json.dumps(plain)  # return_token_ids was not ignored


def test_unknown_nested_and_message_fields_are_ignored(http) -> None:
    """stream_options is a modelled object: its unknown keys are ignored (and named in the
    warning); a message's extra keys reach the chat template, which ignores them."""
    stream = {**ROUTES["/v1/completions"], "stream": True}
    plain = http.post("/v1/completions", json=stream | {"stream_options": {"include_usage": True}})
    extra = stream | {"stream_options": {"include_usage": True, "foo": 1}}
    tolerant = http.post("/v1/completions", json=extra)
    assert tolerant.status_code == 200, tolerant.text

    def texts_and_usage(response) -> tuple[str, list]:  # noqa: ANN001
        lines = [line for line in response.text.splitlines() if line.startswith("data: {")]
        events = [json.loads(line[6:]) for line in lines]
        text = "".join(c["text"] for e in events for c in e["choices"])
        return text, [e["usage"] for e in events if e.get("usage")]

    assert texts_and_usage(tolerant) == texts_and_usage(plain)
    chat = ROUTES["/v1/chat/completions"]
    messages = [{**MESSAGES[0], "foo": "x"}]
    plain = _answer(http.post("/v1/chat/completions", json=chat))
    assert _answer(http.post("/v1/chat/completions", json=chat | {"messages": messages})) == plain


def test_ignored_fields_are_logged(server, http) -> None:
    name = f"foo_{uuid.uuid4().hex[:8]}"  # the warning is throttled per set of fields
    body = ROUTES["/v1/completions"] | {name: 1, "stream": True}
    body |= {"stream_options": {"include_usage": True, "bar": 2}}
    assert http.post("/v1/completions", json=body).status_code == 200
    expected = f"{IGNORED_FIELDS_WARNING}: {{'{name}', 'stream_options.bar'}}"
    deadline = time.monotonic() + 10
    while not any(expected in line for line in server.log):
        assert time.monotonic() < deadline, "".join(server.log)
        time.sleep(0.05)
    for _ in range(3):  # the same fields again: not logged again within the minute
        assert http.post("/v1/completions", json=body).status_code == 200
    time.sleep(0.2)
    assert sum(expected in line for line in server.log) == 1


@pytest.mark.parametrize(
    ("path", "unsupported", "param"),
    [
        ("/v1/completions", {"length_penalty": 2.0}, "body.length_penalty"),
        ("/v1/completions", {"suffix": "x"}, "body.suffix"),
        ("/v1/chat/completions", {"use_beam_search": True}, "body.use_beam_search"),
    ],
)
def test_unimplemented_parameters_stay_400(http, path: str, unsupported: dict, param: str):
    response = http.post(path, json=ROUTES[path] | {"foo": 1} | unsupported)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


# -- --reject-unknown-fields: the strict variant (an app without an engine: the refusal
# comes before the engine is used) ---------------------------------------------------------


@pytest.fixture(scope="module")
def strict() -> Iterator[TestClient]:
    from hotswap.entrypoints.server.app import build_app
    from hotswap.entrypoints.server.state import ServerConfig

    config = ServerConfig(served_model_name=MODEL, reject_unknown_fields=True)
    with TestClient(build_app(engine=None, config=config)) as client:  # type: ignore[arg-type]
        yield client


@pytest.mark.parametrize("path", list(ROUTES))
def test_reject_unknown_fields_is_400_naming_the_field(strict: TestClient, path: str) -> None:
    extra = EXTRA if "completions" in path else {"foo": 1}
    response = strict.post(path, json=ROUTES[path] | extra)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "body.foo" and error["message"].startswith("foo: ")
    assert "--reject-unknown-fields" in error["message"]


def test_reject_unknown_fields_names_nested_fields(strict: TestClient) -> None:
    body = ROUTES["/v1/completions"] | {"stream": True}
    body |= {"stream_options": {"include_usage": True, "foo": 1}}
    response = strict.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "body.stream_options.foo"


def test_reject_unknown_fields_keeps_other_checks(strict: TestClient) -> None:
    body = ROUTES["/v1/completions"] | {"use_beam_search": True}
    response = strict.post("/v1/completions", json=body)
    assert response.json()["error"]["param"] == "body.use_beam_search"
    # values vLLM's (lax) models refuse too; "stream": "yes" and "n": "2" they accept
    for bad in ({"stream": "maybe"}, {"temperature": 1e300}, {"n": "two"}):
        response = strict.post("/v1/completions", json=ROUTES["/v1/completions"] | bad)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == f"body.{next(iter(bad))}"
    # an odd name is escaped, never a 500 (a lone surrogate cannot be encoded)
    raw = '{"prompt": "hi", "\\ud800x": 1}'
    response = strict.post(
        "/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "body.\\ud800x"


def test_cli_flag_reaches_the_server_config(monkeypatch: pytest.MonkeyPatch) -> None:
    from hotswap.entrypoints.cli import build_parser, run_serve
    from hotswap.entrypoints.server import app as api_server

    configs = []
    monkeypatch.setattr(api_server, "run_server", lambda config, *_: configs.append(config))
    run_serve(build_parser().parse_args(["serve", "tiny"]))
    run_serve(build_parser().parse_args(["serve", "tiny", "--reject-unknown-fields"]))
    assert [c.reject_unknown_fields for c in configs] == [False, True]


# -- the model and the warning ----------------------------------------------------------------


def test_models_record_unknown_fields_and_drop_their_values() -> None:
    body = CompletionRequest.model_validate(
        {"prompt": "hi", "foo": 1, "stream": True, "stream_options": {"bar": 2}} | EXTRA
    )
    assert body.unknown_fields == ("foo", "stream_options.bar")
    assert "foo" not in body.model_dump() and "bar" not in body.model_dump()["stream_options"]
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "x": 1}]})
    assert chat.unknown_fields == () and chat.messages[0]["x"] == 1


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_warning_is_throttled_per_set_of_fields(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    throttle = WarningThrottle(interval_s=60.0, max_per_interval=3, clock=clock)
    caplog.set_level(logging.WARNING)

    def warn(*names: str) -> bool:
        return warn_ignored_fields("/v1/completions", names, throttle)

    assert warn("foo", "bar")
    assert f"{IGNORED_FIELDS_WARNING}: {{'bar', 'foo'}} (/v1/completions;" in caplog.text
    assert not warn("bar", "foo") and not warn("foo", "bar")  # the same set, within 60 s
    assert warn("baz")  # another set is logged at once
    clock.now += 61
    caplog.clear()
    assert warn("foo", "bar")
    assert "2 more requests with these fields since the last warning" in caplog.text
    # at most 3 warnings a minute in all, whatever the names; the rest are counted
    assert warn("a") and warn("b") and not warn("c") and not warn("d")
    clock.now += 61
    caplog.clear()
    assert warn("e")
    assert "2 warnings about other ignored fields held back" in caplog.text
    assert len(caplog.records) == 1


def test_warning_stays_short_and_printable(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    names = [f"field{i:03}" for i in range(500)] + ["\ud800", "x" * 10_000]
    assert warn_ignored_fields("/tokenize", names, WarningThrottle())
    (record,) = caplog.records
    message = record.getMessage()
    assert "(492 more)" in message and len(message) < 1000
    message.encode("utf-8")  # no lone surrogate
