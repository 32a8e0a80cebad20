"""A real `hotswap serve` process on 127.0.0.1 for end-to-end tests."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import re
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

URL_LINE = re.compile(r"hotswap: serving .* at (http://\S+)")
START_TIMEOUT_S = 120.0


class RemoteServer:
    """Starts `python -m hotswap serve MODEL --port 0 ...`, waits for the URL line and a 200
    from /health; `stop()` sends SIGINT (Ctrl-C) and waits for a clean exit."""

    def __init__(self, model: Path | str, *args: str, env: dict[str, str] | None = None) -> None:
        cmd = [sys.executable, "-m", "hotswap", *self.command(model), "--port", "0", *args]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
        )
        self.log: deque[str] = deque(maxlen=400)
        self.url = self._wait_for_url()
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        self.api_key = _flag_value(args, "--api-key")
        self._wait_healthy()

    def command(self, model: Path | str) -> list[str]:
        return ["serve", str(model)]

    def _wait_for_url(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT_S
        assert self.proc.stdout is not None
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            self.log.append(line)
            match = URL_LINE.search(line)
            if match:
                return match.group(1)
        self.proc.kill()
        raise RuntimeError("server did not start:\n" + "".join(self.log))

    def _drain(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line)

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError("server never became healthy:\n" + "".join(self.log))

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, timeout: float = 60.0) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=timeout)

    def async_client(self, timeout: float = 60.0) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers=self.headers, timeout=timeout)

    def openai(self):  # noqa: ANN201 - openai.OpenAI
        import openai

        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none")

    def async_openai(self):  # noqa: ANN201 - openai.AsyncOpenAI
        import openai

        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(2)  # SIGINT, as Ctrl-C
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise RuntimeError("server ignored Ctrl-C:\n" + "".join(self.log)) from None
        return self.proc.returncode

    def __enter__(self) -> RemoteServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RemoteRouter(RemoteServer):
    """`python -m hotswap route URL... --port 0 ...` (urls: one string, space-separated)."""

    def command(self, model: Path | str) -> list[str]:
        return ["route", *str(model).split()]


@contextlib.contextmanager
def concurrent_servers(
    *specs: Sequence[Path | str], envs: Sequence[dict[str, str] | None] = ()
) -> Iterator[list[RemoteServer]]:
    """Several `RemoteServer(*spec, env=env)` started at once (listed as given): a start-up
    mostly runs on one core (the server's imports, then its engine process's), so on two
    cores two start-ups take little longer than one. All are stopped on exit, and the ones
    that did start are stopped when another one fails to."""
    envs = list(envs) or [None] * len(specs)
    with concurrent.futures.ThreadPoolExecutor(len(specs)) as pool:
        futures = [pool.submit(RemoteServer, *spec, env=env) for spec, env in zip(specs, envs)]
    with contextlib.ExitStack() as stack:
        for future in futures:
            if future.exception() is None:
                stack.callback(future.result().stop)
        yield [future.result() for future in futures]  # raises the first failure, if any


def _flag_value(args: tuple[str, ...], flag: str) -> str | None:
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None
