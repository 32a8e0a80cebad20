"""Plumbing shared by the `rlhf_http_*.py` examples: start and stop a `hotswap serve`
subprocess, generate through its OpenAI API, load the trainer-side model, and the
demonstration both examples run (complete, sync, complete again). How each trainer sets up
its channel is spelled out in the example itself."""

from __future__ import annotations

import contextlib
import json
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import httpx
import torch
from openai import OpenAI

STARTUP_TIMEOUT_S = 300.0
PROMPT = "The capital of France is"


def free_port() -> int:
    """A TCP port nobody listens on right now (for the gloo rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _pump(stream: Any, lines: queue.Queue[str | None]) -> None:
    """Read the server's stdout to the end (so the pipe never fills up)."""
    for line in stream:
        lines.put(line)
    lines.put(None)


def _wait_for_url(proc: subprocess.Popen, lines: queue.Queue[str | None]) -> tuple[str, str]:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1.0)
        except queue.Empty:
            continue
        if line is None:
            raise RuntimeError(f"hotswap serve exited early (code {proc.wait()})")
        if line.startswith("hotswap: serving ") and " at " in line:
            name, url = line.removeprefix("hotswap: serving ").rsplit(" at ", 1)
            return name, url.strip()
    raise TimeoutError(f"hotswap serve printed no URL within {STARTUP_TIMEOUT_S:.0f} s")


def _wait_healthy(url: str) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/health", timeout=5.0).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{url}/health did not answer 200 within {STARTUP_TIMEOUT_S:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    """Ctrl-C first (the server shuts its engine process down), kill if it hangs."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def serve(
    weight_transfer_config: dict[str, Any],
    extra_args: Sequence[str] = (),
    real_weights: bool = False,
) -> Iterator[tuple[str, str]]:
    """`hotswap serve` (built-in model, random weights unless `real_weights`, control plane
    on, free port); yields (served model name, base URL) once /health answers; always torn
    down."""
    load = [] if real_weights else ["--load-format", "dummy"]
    cmd = [sys.executable, "-m", "hotswap", "serve", *load, *extra_args]
    cmd += ["--enable-control", "--port", "0", "--log-level", "warning"]
    cmd += ["--weight-transfer-config", json.dumps(weight_transfer_config)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    lines: queue.Queue[str | None] = queue.Queue()
    threading.Thread(target=_pump, args=(proc.stdout, lines), daemon=True).start()
    try:
        name, url = _wait_for_url(proc, lines)
        _wait_healthy(url)
        yield name, url
    finally:
        _stop(proc)


def complete(url: str, model: str) -> tuple[str, Any]:
    """Greedy completion of PROMPT: (text, its weight-version spans)."""
    client = OpenAI(base_url=f"{url}/v1", api_key="none")
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0)
    choice = out.choices[0]
    return choice.text, (choice.model_extra or {}).get("weight_versions")


def control(url: str, method: str, path: str) -> dict[str, Any]:
    """One control-plane call (e.g. POST /pause?mode=keep); raises on an error status."""
    response = httpx.request(method, f"{url}{path}", timeout=60.0)
    response.raise_for_status()
    return response.json()


def load_trainer_model() -> torch.nn.Module:
    """The trainer's policy: the real built-in model, loaded by transformers."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    from hotswap.default_model import default_model_dir

    logging.disable_progress_bar()
    path = default_model_dir()
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def sync_round(url: str, engine: Any, model: torch.nn.Module, channel: str) -> None:
    """One update as an RL loop does it: pause in keep mode, send every weight, resume."""
    print(f"pause: {control(url, 'POST', '/pause?mode=keep')}")
    start = time.perf_counter()
    engine.send_weights("real-weights")
    millions = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"sent {millions:.0f}M parameters {channel} in {time.perf_counter() - start:.2f} s")
    print(f"resume: {control(url, 'POST', '/resume')}")
    engine.shutdown()
    engine.client.close()


def demo(weight_transfer_config: dict[str, Any], sync_weights: Callable[[str], None]) -> None:
    """Random weights answer gibberish; after `sync_weights(url)` the same prompt doesn't."""
    with serve(weight_transfer_config) as (name, url):
        print(f"server: {name} at {url}")
        print(f"weight_info before: {control(url, 'GET', '/weight_info')}")
        text, spans = complete(url, name)
        print(f"random weights: {PROMPT!r} -> {text!r}\n  weight_versions: {spans}")
        sync_weights(url)
        print(f"weight_info after:  {control(url, 'GET', '/weight_info')}")
        text, spans = complete(url, name)
        print(f"real weights:   {PROMPT!r} -> {text!r}\n  weight_versions: {spans}")
