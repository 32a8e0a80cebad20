"""Hostile and malformed input against one server: each is refused with a 4xx naming the
field (never a 500), and afterwards the server answers /health at once on a fresh and on
the kept-alive connection, its weights are unchanged and no round is open."""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.reliability.conftest import assert_unharmed, weight_state

# Every test here starts or talks to a server: slow.
pytestmark = pytest.mark.slow

COMPLETION = {"model": "tiny", "max_tokens": 2}
CHAT = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def _refused(r: httpx.Response, status: int = 400, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["code"] == status
    if param is not None:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {**COMPLETION, "prompt": "a\ud800b"}, "body.prompt"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "\udfff"}]},
         "body.messages"),
        ("/tokenize", {"prompt": "a\ud800b"}, "body.prompt"),
        ("/v1/completions", {**COMPLETION, "prompt": "hi", "stream": "maybe"}, "body.stream"),
        ("/v1/completions", {**COMPLETION, "prompt": "hi", "temperature": 1e308},
         "body.temperature"),
        ("/v1/completions", {**COMPLETION, "prompt": "hi", "n": "two"}, "body.n"),
        ("/v1/chat/completions", {**CHAT, "chat_template": "{% for i in range(9) %}x{% endfor %}"},
         "body.chat_template"),
        ("/tokenize", {"messages": CHAT["messages"], "chat_template": "x"}, "body.chat_template"),
        ("/pause_generation", {"mode": ["abort"]}, "body.mode"),
        ("/update_weight_version", {"new_version": "v\ud800"}, "body.new_version"),
        ("/update_weights_from_disk", {"model_path": "x" * 5000}, "body.model_path"),
        ("/abort_requests", {"request_ids": ["\ud800"]}, "body.request_ids[0]"),
        ("/init_weight_transfer_engine", {"init_info": {"master_address": "127.0.0.1",
         "master_port": 70000, "world_size": 2}}, "body.init_info.master_port"),
        ("/init_weight_transfer_engine", {"init_info": {"master_address": "127.0.0.1",
         "master_port": 29500, "world_size": 2**40}}, "body.init_info.world_size"),
    ],
)  # fmt: skip
def test_bad_values_are_400_naming_the_field(gloo_server, path: str, body: dict, param: str):
    before = weight_state(gloo_server)
    with gloo_server.client() as client:
        # ensure_ascii keeps lone surrogates as \\ud800 escapes, as a hostile client sends them
        headers = {"content-type": "application/json"}
        r = client.post(path, content=json.dumps(body), headers=headers)
        _refused(r, 400, param)
        assert_unharmed(gloo_server, client, before)


@pytest.mark.parametrize("timeout_s", ["1e300", "Infinity", "NaN", "601"])
def test_gloo_timeout_out_of_bounds_is_400(gloo_server, timeout_s: str) -> None:
    before = weight_state(gloo_server)
    raw = ('{"init_info": {"master_address": "127.0.0.1", "master_port": 29500, '
           f'"world_size": 2, "timeout_s": {timeout_s}}}}}')  # fmt: skip
    with gloo_server.client() as client:
        r = client.post("/init_weight_transfer_engine", content=raw)
        error = _refused(r, 400, "body.init_info.timeout_s")
        assert "600" in error["message"]
        assert_unharmed(gloo_server, client, before)


@pytest.mark.parametrize(
    "path",
    ["/pause_generation", "/abort_requests", "/init_weight_transfer_engine", "/update_weights",
     "/finish_weight_update", "/start_weight_update"],
)  # fmt: skip
def test_deeply_nested_json_is_400(gloo_server, path: str) -> None:
    before = weight_state(gloo_server)
    with gloo_server.client() as client:
        r = client.post(path, content='{"x": ' + _nested(100_000) + "}")
        _refused(r, 400)
        assert_unharmed(gloo_server, client, before)


def _write_safetensors(path: Path, header: dict, data: bytes) -> None:
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


@pytest.mark.parametrize("kind", ["corrupt", "symlink", "lying"])
def test_bad_checkpoint_on_disk_is_400(gloo_server, tmp_path: Path, kind: str) -> None:
    before = weight_state(gloo_server)
    directory = tmp_path / "ckpt"
    directory.mkdir()
    target = directory / "model.safetensors"
    if kind == "corrupt":
        target.write_bytes(b"\xff" * 64)
    elif kind == "symlink":
        target.symlink_to("/etc/passwd")
    else:  # 100 GB of float32 declared, 16 bytes present
        entry = {"dtype": "F32", "shape": [25_000_000_000], "data_offsets": [0, 100_000_000_000]}
        _write_safetensors(target, {"model.norm.weight": entry}, b"\0" * 16)
    with gloo_server.client() as client:
        r = client.post("/update_weights_from_disk", json={"model_path": str(directory)})
        _refused(r, 400, "body.model_path")
        assert_unharmed(gloo_server, client, before)


def test_oversized_body_is_413_before_it_is_read(gloo_server) -> None:
    """50 MB announced: refused at once, while /health stays fast."""
    latencies: list[float] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=gloo_server.url, timeout=10) as c:
            while not stop.is_set():
                start = time.perf_counter()
                assert c.get("/health").status_code == 200
                latencies.append(time.perf_counter() - start)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        body = b'{"prompt": "' + b"a" * (50 << 20) + b'", "max_tokens": 1}'
        start = time.perf_counter()
        r = httpx.post(f"{gloo_server.url}/v1/completions", content=body, timeout=120,
                       headers={"content-type": "application/json"})  # fmt: skip
        elapsed = time.perf_counter() - start
        _refused(r, 413, "body")

        def chunks():  # no Content-Length: refused once the limit is passed
            for _ in range(50):
                yield b"a" * (1 << 20)

        r = httpx.post(f"{gloo_server.url}/v1/completions", content=chunks(), timeout=120)
        _refused(r, 413)
    finally:
        stop.set()
        poller.join()
    latencies.sort()
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    print(f"413 after {elapsed * 1000:.0f} ms; /health p99 {p99 * 1000:.1f} ms "
          f"over {len(latencies)} calls")  # fmt: skip
    assert p99 < 0.5
    with gloo_server.client() as client:
        assert_unharmed(gloo_server, client, weight_state(gloo_server))


def test_long_prompt_refused_without_stalling_other_clients(gloo_server) -> None:
    """A prompt far beyond max_model_len is refused before it is tokenized (and whatever
    is tokenized runs off the event loop): /health answers at once meanwhile."""
    prompt = "hello world " * (2 << 20)  # 24 MB of text
    done = threading.Event()
    result: list[httpx.Response] = []

    def send() -> None:
        result.append(httpx.post(f"{gloo_server.url}/v1/completions", timeout=120,
                                 json={**COMPLETION, "prompt": prompt}))  # fmt: skip
        done.set()

    threading.Thread(target=send).start()
    worst = 0.0
    while not done.is_set():
        start = time.perf_counter()
        assert httpx.get(f"{gloo_server.url}/health", timeout=10).status_code == 200
        worst = max(worst, time.perf_counter() - start)
        time.sleep(0.01)
    _refused(result[0], 400, "body.prompt")
    assert worst < 2.0, worst


def test_connection_survives_a_500(v1_dir) -> None:
    """An exception no handler knows becomes the JSON 500 envelope and the kept-alive
    connection stays usable (Starlette's last-resort handler re-raised, and the server
    reset the connection under a pooled client)."""
    import asyncio

    import uvicorn

    from hotswap.entrypoints.server.app import build_app
    from hotswap.entrypoints.server.state import ServerConfig

    app = build_app(engine=None, config=ServerConfig(served_model_name="tiny"))  # type: ignore[arg-type]

    @app.get("/boom")
    async def boom() -> None:
        raise RuntimeError("boom")

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])))
    thread.start()
    try:
        while not server.started:
            time.sleep(0.01)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            reader = conn.makefile("rb")
            for _ in range(2):  # twice on the same connection
                conn.sendall(b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n")
                status = reader.readline()
                assert b" 500 " in status, status
                headers = {}
                while (line := reader.readline()) not in (b"\r\n", b""):
                    key, _, value = line.decode().partition(":")
                    headers[key.strip().lower()] = value.strip()
                body = json.loads(reader.read(int(headers["content-length"])))
                assert body["error"]["code"] == 500 and "boom" in body["error"]["message"]
                assert headers.get("connection") != "close"
    finally:
        server.should_exit = True
        thread.join()
