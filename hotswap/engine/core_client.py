"""Front-end side of the engine core: send requests, aborts and control calls; receive
batches of outputs through a callback (called on the client's own thread).

`InprocEngineClient` runs the engine core loop in a thread of this process; a process
client (ZMQ) implements the same interface, and a data-parallel client can fan calls out
over several of them.
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from hotswap.config import EngineConfig
from hotswap.engine.core import EngineCore
from hotswap.engine.core_loop import EngineCoreLoop, InputKind
from hotswap.engine.messages import EngineCoreOutputs, EngineCoreRequest, UtilityCall

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
