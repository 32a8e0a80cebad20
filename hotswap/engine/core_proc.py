"""The engine core in a child process: ZMQ in, the busy loop, ZMQ out.

Started as `python -m hotswap.engine.core_proc INPUT OUTPUT ENGINE_ARGS_JSON` rather than
through multiprocessing, so the parent's `__main__` is never re-imported (scripts need no
`if __name__ == "__main__"` guard) and only plain JSON crosses into the child.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
import zmq

from hotswap.config import EngineConfig
from hotswap.engine.core import EngineCore
from hotswap.engine.core_client import SOCKET_DIR_PREFIX
from hotswap.engine.core_loop import EngineCoreLoop, InputKind
from hotswap.engine.messages import EngineCoreOutputs
from hotswap.engine.wire import READY, decode_input, encode_outputs
from hotswap.engine_args import EngineArgs

logger = logging.getLogger(__name__)

PARENT_POLL_S = 1.0


def run_engine_core(
    input_addr: str, output_addr: str, args_json: str, server_key: bytes | None = None
) -> bool:
    """Build the engine core from its arguments (JSON of `EngineArgs`), connect to the
    front-end, say READY and serve until SHUTDOWN. Returns whether the loop failed; raises
    if start-up fails. Shared by the child process (`main`) and the Ray actor
    (hotswap.ray.dp), which both connect to sockets the front-end bound; `server_key`: the
    front-end's CURVE public key when its sockets require CURVE (TCP)."""
    args = EngineArgs(**json.loads(args_json))
    if args.num_threads is not None:
        torch.set_num_threads(args.num_threads)
    config = args.create_engine_config()
    return serve_engine_core(config, input_addr, output_addr, server_key)


def serve_engine_core(
    config: EngineConfig, input_addr: str, output_addr: str, server_key: bytes | None = None
) -> bool:
    """Loads the model, says READY, then serves until SHUTDOWN; returns whether the loop
    failed. After a failure the input thread may still block in recv, so its socket and
    ZMQ context are left open: the process ends (or the actor is killed) right after."""
    context = zmq.Context()
    output = _connect(context, zmq.PUSH, output_addr, server_key)
    try:
        core = EngineCore(config, progress=False)
    except Exception as e:  # noqa: BLE001 - report why start-up failed, then exit
        output.send(encode_outputs(EngineCoreOutputs(engine_error=f"start-up failed: {e}")))
        output.close(linger=1000)
        raise
    inbox: queue.Queue[tuple[InputKind, Any]] = queue.Queue()
    # Connected here, before READY, then owned by the reader thread alone.
    sock = _connect(context, zmq.PULL, input_addr, server_key)
    sock.setsockopt(zmq.RCVHWM, 0)
    reader = threading.Thread(
        target=_read_inputs, args=(sock, inbox), name="hotswap-core-input", daemon=True
    )
    reader.start()
    output.send(READY)
    loop = EngineCoreLoop(core, inbox, lambda batch: output.send(encode_outputs(batch)))
    loop.run()
    output.close(linger=2000)  # flush the last outputs
    if not loop.failed:
        reader.join(timeout=5)  # it closes its socket on SHUTDOWN
        if not reader.is_alive():
            context.term()
    return loop.failed


def _connect(context: zmq.Context, kind: int, addr: str, server_key: bytes | None) -> zmq.Socket:
    sock = context.socket(kind)
    if addr.startswith("tcp://["):  # an IPv6 node address (hotswap.ray.dp)
        sock.setsockopt(zmq.IPV6, 1)
    if server_key is not None:  # a CURVE client of the front-end, with a key of its own
        sock.curve_serverkey = server_key
        sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
    sock.connect(addr)
    return sock


def _read_inputs(sock: zmq.Socket, inbox: queue.Queue[tuple[InputKind, Any]]) -> None:
    """Owns the input socket (ZMQ sockets are not thread-safe) and feeds the loop's inbox.
    If it fails the process exits, so the front-end sees a dead core instead of a deaf one."""
    try:
        while True:
            kind, payload = decode_input(sock.recv_multipart())
            inbox.put((kind, payload))
            if kind == InputKind.SHUTDOWN:
                sock.close(linger=0)
                return
    except Exception:  # noqa: BLE001
        logger.exception("engine core input reader died")
        os._exit(1)


def _watch_parent(parent_pid: int, input_addr: str) -> None:
    """Exit when the front-end process is gone (killed without a chance to shut us down),
    so no orphaned engine keeps its memory, and remove the sockets' private directory the
    front-end can no longer clean up."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_POLL_S)
    socket_dir = Path(input_addr.removeprefix("ipc://")).parent
    if socket_dir.name.startswith(SOCKET_DIR_PREFIX):
        shutil.rmtree(socket_dir, ignore_errors=True)
    os._exit(1)


def main(argv: list[str]) -> None:
    input_addr, output_addr, args_json = argv
    # Ctrl-C reaches the whole process group; the front-end owns our shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    threading.Thread(
        target=_watch_parent,
        args=(os.getppid(), input_addr),
        name="hotswap-parent-watch",
        daemon=True,
    ).start()
    failed = run_engine_core(input_addr, output_addr, args_json)
    # Exit without interpreter teardown: after a crash the input thread may still block
    # in recv, and terminating its ZMQ context would wait for it forever.
    os._exit(1 if failed else 0)


if __name__ == "__main__":
    main(sys.argv[1:])
