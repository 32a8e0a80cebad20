"""Forming a broadcast group from its own TCPStore, cancellably whichever rank hosts it.

Rank 0 hosts the store (listening on the address it was given only); the other ranks wait
for it to listen, then connect. Every wait for another rank can be cancelled (`cancel`, a
`threading.Event`: the engine sets it when `finish_weight_update(abort=True)` cancels an
init still waiting for its trainer):
- a rank that does not host the store probes for it before connecting (torch's connect
  retries for the whole timeout inside one uninterruptible call);
- on gloo, the group's rendezvous (every rank publishing its address and reading the
  others') goes through `SlicedStore`, whose waits poll in short slices. The hosting rank
  does not use torch's `wait_for_workers` (a loop inside the store's constructor that
  nothing can interrupt for the whole timeout): the group's rendezvous already waits for
  every rank, and that wait is the sliced one (the store's own where nothing can cancel:
  a trainer's join).
NCCL forms its communicator at the first collective, so its group's constructor waits for
nobody: there the hosting rank keeps torch's `wait_for_workers`, the one wait left that a
cancel does not end (it ends at the timeout).
"""

from __future__ import annotations

import datetime
import socket
import threading
import time

import torch
import torch.distributed as dist

from hotswap.errors import InvalidArgument

PROBE_INTERVAL_S = 0.1
# A sliced wait polls the store first after POLL_MIN_S, then at doubling intervals up to
# POLL_MAX_S: a key that is already there costs nothing, a cancel ends a wait within
# POLL_MAX_S.
POLL_MIN_S = 0.001
POLL_MAX_S = 0.05


class RendezvousCancelled(RuntimeError):
    """Joining a group was cancelled (the round was aborted) before every rank joined."""


def join_group(
    address: str,
    port: int,
    rank: int,
    world_size: int,
    device: torch.device,
    timeout_s: float,
    cancel: threading.Event | None = None,
    group_name: str | None = None,
) -> dist.ProcessGroup:
    """Rank 0 hosts the store, listening on `address` only (never on every interface).
    Blocks until every rank has joined (or the timeout). Invariant: once `cancel` is set,
    a wait for another rank ends within PROBE_INTERVAL_S (after a connection attempt in
    progress, at most 1 s), raising RendezvousCancelled, whether this rank hosts the store
    or not (on NCCL, the host's wait excepted: see the module docstring); a join that
    fails leaves no store behind (its port is free). `group_name`: the group's keys are
    laid out as torch's process-group helpers lay out a group of that name (see
    `torch_group_store`), so a trainer that creates its group with them can be met."""
    timeout = datetime.timedelta(seconds=timeout_s)
    store = _open_store(address, port, rank, world_size, device, timeout, cancel)
    try:
        return _form_group(store, rank, world_size, device, timeout, group_name)
    except Exception as e:
        # The frames of the error's traceback hold the store, and so its port, for as long
        # as the error lives: release it now (a cancelled join's port is free at once).
        del store
        raise e.with_traceback(None) from None


def _open_store(
    address: str,
    port: int,
    rank: int,
    world_size: int,
    device: torch.device,
    timeout: datetime.timedelta,
    cancel: threading.Event | None,
) -> dist.Store:
    """The group's store: hosted here (rank 0) or reached; on gloo with a `cancel`, with
    sliced waits."""
    nccl = device.type == "cuda"
    store: dist.Store
    if rank == 0:
        listener = _listen(address, port)
        store = dist.TCPStore(address, port, world_size, is_master=True, timeout=timeout,
                              wait_for_workers=nccl, master_listen_fd=listener)  # fmt: skip
    else:
        _wait_for_store(address, port, timeout.total_seconds(), cancel)
        store = dist.TCPStore(address, port, world_size, is_master=False, timeout=timeout)
    return store if nccl or cancel is None else SlicedStore(store, timeout, cancel)


def _form_group(
    store: dist.Store,
    rank: int,
    world_size: int,
    device: torch.device,
    timeout: datetime.timedelta,
    group_name: str | None,
) -> dist.ProcessGroup:
    """The process group over `store` (under `group_name`'s keys, if any); on gloo,
    returns once every rank has joined."""
    keys = store if group_name is None else torch_group_store(store, group_name, device)
    group: dist.ProcessGroup
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout  # the watchdog's limit for a collective
        group = dist.ProcessGroupNCCL(keys, rank, world_size, options)
    else:
        group = _GlooGroup(keys, rank, world_size, timeout, store)
    if group_name is not None:
        group._set_sequence_number_for_group()  # as the helpers do (rank 0 publishes it)
    return group


class _GlooGroup(dist.ProcessGroupGloo):
    """A gloo group that keeps its Python store alive: the group's C++ side holds the
    store, but not the Python object behind it (a `SlicedStore`, and so the TCPStore it
    wraps, would be freed as the join returns, and with it the store's server).
    Invariant: `store` lives as long as the group."""

    def __init__(
        self,
        keys: dist.Store,
        rank: int,
        world_size: int,
        timeout: datetime.timedelta,
        store: dist.Store,
    ) -> None:
        super().__init__(keys, rank, world_size, timeout)
        self.store = store


class SlicedStore(dist.Store):
    """`inner` with waits that a cancel can end: `get` and `wait` poll `check` (which never
    blocks) in slices of at most POLL_MAX_S instead of blocking inside the store.

    Invariants: `get` and `wait` return once their keys exist; they raise
    RendezvousCancelled within POLL_MAX_S of `cancel` being set, and DistStoreError (as
    torch's store does) once their timeout (`timeout` unless the caller gives one; zero:
    none) has passed. The inner store is never left inside a wait that was cut short, so it
    stays usable. Every other call is the inner store's."""

    def __init__(
        self, inner: dist.Store, timeout: datetime.timedelta, cancel: threading.Event
    ) -> None:
        super().__init__()
        self._inner, self._timeout, self._cancel = inner, timeout, cancel

    def set(self, key: str, value: bytes | str) -> None:
        self._inner.set(key, value)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return self._inner.get(key)

    def add(self, key: str, value: int) -> int:
        return self._inner.add(key, value)

    def compare_set(self, key: str, expected: bytes | str, desired: bytes | str) -> bytes:
        return self._inner.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self._inner.delete_key(key)

    def num_keys(self) -> int:
        return self._inner.num_keys()

    def check(self, keys: list[str]) -> bool:
        return self._inner.check(keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        limit = (self._timeout if timeout is None else timeout).total_seconds()
        deadline = time.monotonic() + limit if limit > 0 else float("inf")
        pause = POLL_MIN_S
        while not self._inner.check(keys):
            if self._cancel.is_set():
                raise RendezvousCancelled("init_weight_transfer_engine: cancelled")
            if time.monotonic() >= deadline:
                raise dist.DistStoreError(f"wait timeout after {limit * 1000:.0f}ms, keys: {keys}")
            self._cancel.wait(pause)
            pause = min(2 * pause, POLL_MAX_S)


def torch_group_store(store: dist.Store, group_name: str, device: torch.device) -> dist.Store:
    """`store` as the backend of a group named `group_name` sees it when the group is made
    the way SGLang's `init_custom_process_group` makes it (slime's and AReaL's trainers use
    copies): the rendezvous store prefixed with the name, then torch's
    `_new_process_group_helper` prefixes `{group_name}/` and the device type. Joining with
    these keys meets such a trainer without torch's global group registry. The layout is
    torch's (stable since 2.0; checked against the installed torch in the tests)."""
    named = dist.PrefixStore(f"{group_name}/", dist.PrefixStore(group_name, store))
    return dist.PrefixStore("cuda/" if device.type == "cuda" else "cpu/", named)


def _listen(address: str, port: int) -> int:
    """A socket listening on `address`:`port` only; its descriptor goes to the store."""
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(sockaddr)
            sock.listen(128)
        except OSError:
            sock.close()
            raise
    except OSError as e:
        # The trainer's side (rank 0): its GlooTrainerInitInfo.master_address.
        raise InvalidArgument(
            "master_address", f"master_address: cannot listen on {address}:{port} ({e})"
        ) from None
    return sock.detach()  # the store owns and closes it


def _wait_for_store(
    address: str, port: int, timeout_s: float, cancel: threading.Event | None
) -> None:
    """Until something accepts connections at address:port. torch's own connect retries
    for the whole timeout inside one uninterruptible call; probing first keeps a wrong or
    closed port cancellable (`/finish_weight_update {"abort": true}`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection((address, port), timeout=min(1.0, max(remaining, 0.01))):
                return
        except OSError as e:
            error = e
        if cancel is not None and cancel.is_set():
            raise RendezvousCancelled("init_weight_transfer_engine: cancelled")
        if time.monotonic() >= deadline:
            raise InvalidArgument(
                "init_info.master_port",
                f"init_info.master_port: no store answered at {address}:{port} within "
                f"{timeout_s:g} s ({error})",
            )
        if cancel is not None:
            cancel.wait(PROBE_INTERVAL_S)
        else:
            time.sleep(PROBE_INTERVAL_S)
