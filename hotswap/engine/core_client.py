"""Front-end side of the engine core: send requests, aborts and control calls; receive
batches of outputs through a callback (called on the client's own thread).

`InprocEngineClient` runs the engine core loop in a thread of this process; a process
client (ZMQ) implements the same interface, and a data-parallel client can fan calls out
over several of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import zmq  # noqa: E402  (grouped with the transport it serves)

from hotswap.config import EngineArgs, EngineConfig
from hotswap.engine.core import EngineCore
from hotswap.engine.core_loop import EngineCoreLoop, InputKind
from hotswap.engine.messages import EngineCoreOutputs, EngineCoreRequest, UtilityCall
from hotswap.engine.wire import READY, decode_outputs, encode_input

# The child removes its socket directory by this prefix if we die first (core_proc.py).
SOCKET_DIR_PREFIX = "hotswap-core-"

OutputHandler = Callable[[EngineCoreOutputs], None]


class EngineCoreClient(ABC):
    @abstractmethod
    def start(self, on_outputs: OutputHandler) -> None: ...

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def call_utility(self, call: UtilityCall) -> None: ...

    @abstractmethod
    def shutdown(self) -> None: ...


class InprocEngineClient(EngineCoreClient):
    """The engine core loop on a daemon thread; torch releases the GIL inside its kernels,
    so the asyncio front-end stays responsive while a step runs."""

    def __init__(self, config: EngineConfig, progress: bool = True) -> None:
        self.core = EngineCore(config, progress=progress)
        self.inbox: queue.Queue[tuple[InputKind, Any]] = queue.Queue()
        self.thread: threading.Thread | None = None

    def start(self, on_outputs: OutputHandler) -> None:
        loop = EngineCoreLoop(self.core, self.inbox, on_outputs)
        self.thread = threading.Thread(target=loop.run, name="hotswap-engine-core", daemon=True)
        self.thread.start()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.inbox.put((InputKind.ADD, request))

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self.inbox.put((InputKind.ABORT, list(request_ids)))

    def call_utility(self, call: UtilityCall) -> None:
        self.inbox.put((InputKind.UTILITY, call))

    def shutdown(self) -> None:
        self.inbox.put((InputKind.SHUTDOWN, None))
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=30)
        self.thread = None


class MPEngineClient(EngineCoreClient):
    """The engine core in a child process, over two ZMQ IPC sockets in a private temporary
    directory (no ports). If the process dies, one `engine_error` batch reaches the handler
    within ~0.1 s, so every pending stream and call fails at once instead of hanging."""

    POLL_MS = 100

    def __init__(self, engine_args: EngineArgs, startup_timeout: float = 600.0) -> None:
        self.tmpdir = tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX)
        self.context = zmq.Context()
        self.input = self.context.socket(zmq.PUSH)
        self.input.setsockopt(zmq.SNDHWM, 0)  # queue without limit while the core is busy
        self.input.bind(f"ipc://{self.tmpdir}/input")
        self.output = self.context.socket(zmq.PULL)
        self.output.bind(f"ipc://{self.tmpdir}/output")
        self.send_lock = threading.Lock()
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hotswap.engine.core_proc",
                f"ipc://{self.tmpdir}/input",
                f"ipc://{self.tmpdir}/output",
                json.dumps(dataclasses.asdict(engine_args)),
            ],
            stdin=subprocess.DEVNULL,
        )
        self.receiver: threading.Thread | None = None
        self.closed = False
        self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout: float) -> None:
        waited = 0.0
        while not self.output.poll(self.POLL_MS):
            waited += self.POLL_MS / 1000
            if self.process.poll() is not None or waited > timeout:
                self.shutdown()
                raise RuntimeError(
                    f"engine core process failed to start (exit code {self.process.returncode})"
                )
        message = self.output.recv()
        if message != READY:
            error = decode_outputs(message).engine_error
            self.shutdown()
            raise RuntimeError(f"engine core process: {error}")

    def start(self, on_outputs: OutputHandler) -> None:
        self.receiver = threading.Thread(
            target=self._receive, args=(on_outputs,), name="hotswap-core-output", daemon=True
        )
        self.receiver.start()

    def _receive(self, on_outputs: OutputHandler) -> None:
        while not self.closed:
            if self.output.poll(self.POLL_MS):
                on_outputs(decode_outputs(self.output.recv()))
            elif self.process.poll() is not None:
                if not self.closed:
                    on_outputs(
                        EngineCoreOutputs(
                            engine_error=(
                                f"engine core process exited with code {self.process.returncode}"
                            )
                        )
                    )
                return

    def _send(self, kind: InputKind, payload: Any) -> None:
        """Never blocks on a dead core: with the process gone a PUSH socket has no peer and
        a plain send would wait forever, so we wait for room in short polls, checking the
        process in between; sends to a dead core are dropped (its death is reported)."""
        frames = encode_input(kind, payload)
        with self.send_lock:
            while not self.closed and self.process.poll() is None:
                if self.input.poll(self.POLL_MS, zmq.POLLOUT):
                    self.input.send_multipart(frames, flags=zmq.NOBLOCK)
                    return

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(InputKind.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(InputKind.ABORT, list(request_ids))

    def call_utility(self, call: UtilityCall) -> None:
        self._send(InputKind.UTILITY, call)

    def shutdown(self) -> None:
        if self.closed:
            return
        if self.process.poll() is None:
            self._send(InputKind.SHUTDOWN, None)
            _wait(self.process, 10)
        if self.process.poll() is None:
            self.process.kill()
            _wait(self.process, 5)
        self.closed = True
        if self.receiver is not None and self.receiver is not threading.current_thread():
            self.receiver.join(timeout=5)
        with self.send_lock:
            self.input.close(linger=0)
            self.output.close(linger=0)
            self.context.term()
        shutil.rmtree(self.tmpdir, ignore_errors=True)


def _wait(process: subprocess.Popen, timeout: float) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=timeout)
