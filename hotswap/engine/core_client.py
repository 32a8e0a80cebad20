"""Front-end side of the engine core: send requests, aborts and control calls; receive
batches of outputs through a callback (called on the client's own thread).

`InprocEngineClient` runs the engine core loop in a thread of this process; `MPEngineClient`
(ZMQ) implements the same interface with the core elsewhere (a `CoreRunner`: a child
process, or a Ray actor in hotswap.ray.dp), and a data-parallel client can fan calls out
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

from hotswap.config import EngineConfig
from hotswap.engine.core import EngineCore
from hotswap.engine.core_loop import EngineCoreLoop, InputKind
from hotswap.engine.messages import EngineCoreOutputs, EngineCoreRequest, UtilityCall
from hotswap.engine.wire import READY, decode_outputs, encode_input
from hotswap.engine_args import EngineArgs

# The child removes its socket directory by this prefix if we die first (core_proc.py).
SOCKET_DIR_PREFIX = "hotswap-core-"

OutputHandler = Callable[[EngineCoreOutputs], None]


class EngineCoreClient(ABC):
    @abstractmethod
    def start(self, on_outputs: OutputHandler) -> None: ...

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str], stopped: bool = False) -> None:
        """`stopped`: a stop string ended them in the front end, which still awaits their
        final outputs (return_bf16_logprobs scores them first: engine/scoring.py)."""

    @abstractmethod
    def call_utility(self, call: UtilityCall) -> None: ...

    @abstractmethod
    def shutdown(self) -> None: ...

    def routing_stats(self) -> dict[str, object]:
        """How requests were routed over data-parallel ranks (none: one core)."""
        return {}


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

    def abort_requests(self, request_ids: list[str], stopped: bool = False) -> None:
        if request_ids:
            self.inbox.put((InputKind.STOP if stopped else InputKind.ABORT, list(request_ids)))

    def call_utility(self, call: UtilityCall) -> None:
        self.inbox.put((InputKind.UTILITY, call))

    def shutdown(self) -> None:
        self.inbox.put((InputKind.SHUTDOWN, None))
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=30)
        self.thread = None


class CoreRunner(ABC):
    """Where `MPEngineClient`'s engine core runs: binds the front-end's two sockets, starts
    the core connected to them, says whether it still runs and ends it. `ProcessRunner`:
    a child process; hotswap.ray.dp: a Ray actor."""

    kind = "process"  # named in errors: "engine core process exited with code 1"

    @abstractmethod
    def bind(self, input: zmq.Socket, output: zmq.Socket) -> tuple[str, str]:
        """Bind the front-end's input and output sockets; returns the addresses the core
        connects to, in that order."""

    @abstractmethod
    def start(self, input_addr: str, output_addr: str, engine_args: EngineArgs) -> None: ...

    @abstractmethod
    def alive(self) -> bool: ...

    @abstractmethod
    def exit_description(self) -> str:
        """Why the core is gone (once `alive()` is False), e.g. "exited with code 1"."""

    @abstractmethod
    def stop(self, grace_s: float) -> None:
        """Wait up to `grace_s` for the core to end (it was sent SHUTDOWN), then end it."""

    @abstractmethod
    def close(self) -> None:
        """Release what `bind` made beyond the sockets (run after `stop`)."""


class ProcessRunner(CoreRunner):
    """`python -m hotswap.engine.core_proc` over IPC sockets in a private temporary
    directory (no ports)."""

    def __init__(self) -> None:
        self.tmpdir = tempfile.mkdtemp(prefix=SOCKET_DIR_PREFIX)
        self.process: subprocess.Popen | None = None

    def bind(self, input: zmq.Socket, output: zmq.Socket) -> tuple[str, str]:
        input_addr, output_addr = f"ipc://{self.tmpdir}/input", f"ipc://{self.tmpdir}/output"
        input.bind(input_addr)
        output.bind(output_addr)
        return input_addr, output_addr

    def start(self, input_addr: str, output_addr: str, engine_args: EngineArgs) -> None:
        args_json = json.dumps(dataclasses.asdict(engine_args))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "hotswap.engine.core_proc", input_addr, output_addr, args_json],
            stdin=subprocess.DEVNULL,
        )

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def exit_description(self) -> str:
        code = self.process.returncode if self.process is not None else None
        return f"exited with code {code}"

    def stop(self, grace_s: float) -> None:
        if self.process is None:
            return
        _wait(self.process, grace_s)
        if self.process.poll() is None:
            self.process.kill()
            _wait(self.process, 5)

    def close(self) -> None:
        shutil.rmtree(self.tmpdir, ignore_errors=True)


class MPEngineClient(EngineCoreClient):
    """The engine core out of this process (a child process by default; `runner` says
    where), over two ZMQ sockets the front-end binds. If the core dies, one `engine_error`
    batch reaches the handler within ~0.1 s, so every pending stream and call fails at once
    instead of hanging."""

    POLL_MS = 100

    def __init__(
        self,
        engine_args: EngineArgs,
        startup_timeout: float = 600.0,
        runner: CoreRunner | None = None,
    ) -> None:
        self.runner = runner if runner is not None else ProcessRunner()
        self.context = zmq.Context()
        self.input = self.context.socket(zmq.PUSH)
        self.input.setsockopt(zmq.SNDHWM, 0)  # queue without limit while the core is busy
        self.output = self.context.socket(zmq.PULL)
        self.send_lock = threading.Lock()
        self.receiver: threading.Thread | None = None
        self.closed = False
        try:
            self.runner.start(*self.runner.bind(self.input, self.output), engine_args)
        except BaseException:
            self.shutdown()
            raise
        self._wait_ready(startup_timeout)

    @property
    def process(self) -> subprocess.Popen | None:
        """The child process (the default runner only)."""
        return getattr(self.runner, "process", None)

    @property
    def tmpdir(self) -> str | None:
        """The sockets' private directory (the default runner only)."""
        return getattr(self.runner, "tmpdir", None)

    def _wait_ready(self, timeout: float) -> None:
        waited = 0.0
        kind = self.runner.kind
        while not self.output.poll(self.POLL_MS):
            waited += self.POLL_MS / 1000
            if not self.runner.alive() or waited > timeout:
                reason = self.runner.exit_description() if not self.runner.alive() else None
                self.shutdown()
                raise RuntimeError(
                    f"engine core {kind} failed to start ({reason or f'no READY in {timeout} s'})"
                )
        message = self.output.recv()
        if message != READY:
            error = decode_outputs(message).engine_error
            self.shutdown()
            raise RuntimeError(f"engine core {kind}: {error}")

    def start(self, on_outputs: OutputHandler) -> None:
        self.receiver = threading.Thread(
            target=self._receive, args=(on_outputs,), name="hotswap-core-output", daemon=True
        )
        self.receiver.start()

    def _receive(self, on_outputs: OutputHandler) -> None:
        while not self.closed:
            if self.output.poll(self.POLL_MS):
                on_outputs(decode_outputs(self.output.recv()))
            elif not self.runner.alive():
                if not self.closed:
                    error = f"engine core {self.runner.kind} {self.runner.exit_description()}"
                    on_outputs(EngineCoreOutputs(engine_error=error))
                return

    def _send(self, kind: InputKind, payload: Any) -> None:
        """Never blocks on a dead core: with the core gone a PUSH socket has no peer and a
        plain send would wait forever, so we wait for room in short polls, checking the
        core in between; sends to a dead core are dropped (its death is reported)."""
        frames = encode_input(kind, payload)
        with self.send_lock:
            while not self.closed:
                if self.input.poll(self.POLL_MS, zmq.POLLOUT):
                    self.input.send_multipart(frames, flags=zmq.NOBLOCK)
                    return
                if not self.runner.alive():
                    return

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(InputKind.ADD, request)

    def abort_requests(self, request_ids: list[str], stopped: bool = False) -> None:
        if request_ids:
            self._send(InputKind.STOP if stopped else InputKind.ABORT, list(request_ids))

    def call_utility(self, call: UtilityCall) -> None:
        self._send(InputKind.UTILITY, call)

    def shutdown(self) -> None:
        if self.closed:
            return
        if self.runner.alive():
            self._send(InputKind.SHUTDOWN, None)
        self.runner.stop(grace_s=10)
        self.closed = True
        if self.receiver is not None and self.receiver is not threading.current_thread():
            self.receiver.join(timeout=5)
        with self.send_lock:
            self.input.close(linger=0)
            self.output.close(linger=0)
            self.context.term()
        self.runner.close()


def _wait(process: subprocess.Popen, timeout: float) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=timeout)
