"""The weight plane cannot be wedged or held by a trainer: a rendezvous with a closed port
is cancellable and never makes other calls wait; a cancel ends a join promptly whichever
side hosts the store; a silent trainer's round is aborted after a short idle deadline; the
engine joins only allowed master addresses; a store listens only on the address it was
given."""

from __future__ import annotations

import datetime
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import httpx
import pytest
import torch
import torch.distributed as dist

from hotswap.weight_transfer import (
    GlooTrainerInitInfo,
    HTTPWeightSyncClient,
    ModuleSource,
    WeightTransferTrainerFactory,
)
from hotswap.weight_transfer.broadcast import GlooEngine, join_group
from hotswap.weight_transfer.rendezvous import RendezvousCancelled
from tests.helpers.waiting import wait_until
from tests.reliability.conftest import assert_unharmed, weight_state
from tests.weight_transfer.conftest import free_port


def _complete(client: httpx.Client, timeout: float = 60) -> httpx.Response:
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "temperature": 0}
    return client.post("/v1/completions", json=body, timeout=timeout)


def _send(server, trainer) -> dict:
    client = HTTPWeightSyncClient(server.url)
    info = GlooTrainerInitInfo(master_port=free_port(), world_size=2, timeout_s=30)
    WeightTransferTrainerFactory.trainer_init(info, client, ModuleSource(trainer)).send_weights()
    return weight_state(server)


@pytest.mark.slow
def test_pending_rendezvous_never_wedges_the_weight_plane(gloo_server, v2_trainer) -> None:
    before = weight_state(gloo_server)
    closed_port = free_port()  # nothing listens there
    init = {"init_info": {"master_address": "127.0.0.1", "master_port": closed_port,
                          "world_size": 2, "timeout_s": 600}}  # fmt: skip
    answer: list[httpx.Response] = []
    pending = threading.Thread(
        target=lambda: answer.append(httpx.post(
            f"{gloo_server.url}/init_weight_transfer_engine", json=init, timeout=120
        ))
    )  # fmt: skip
    pending.start()
    with gloo_server.client(timeout=5) as client:
        wait_until(
            lambda: "waiting for the trainer" in client.post("/prepare_weight_update").text,
            "the engine is waiting for the trainer",
        )
        assert client.get("/get_world_size").json() == {"world_size": 1}
        for path, body in [
            ("/init_weight_transfer_engine", init),
            ("/start_weight_update", {}),
            ("/update_weights_from_disk", {"model_path": "/nonexistent"}),
            ("/prepare_weight_update", {}),
        ]:
            r = client.post(path, json=body)
            assert r.status_code == 409, (path, r.text)
            assert "init_weight_transfer_engine" in r.json()["error"]["message"]
        assert _complete(client).status_code == 200  # generation runs meanwhile
        start = time.perf_counter()
        r = client.post("/finish_weight_update", json={"abort": True})
        assert r.status_code == 200, r.text
        pending.join(10)
        assert not pending.is_alive(), "the cancelled init never answered"
        assert answer[0].status_code == 409 and "cancelled" in answer[0].text
        assert time.perf_counter() - start < 5
        assert_unharmed(gloo_server, client, before)
    # A new trainer is accepted at once.
    assert _send(gloo_server, v2_trainer)["digest"] != before["digest"]


def _in_thread(fn: Callable[[], object]) -> Future:
    """`fn()` on a daemon thread (a join that never ends must not hold the test run)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the test
            future.set_exception(e)

    threading.Thread(target=run, daemon=True).start()
    return future


def _accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


@pytest.mark.parametrize("engine_hosts_store", [True, False], ids=["engine-hosts", "trainer-hosts"])
def test_cancel_ends_a_join_whichever_rank_hosts_the_store(engine_hosts_store: bool) -> None:
    """An init waiting for its trainer ends within moments of its cancel, also past the
    store probe: the engine hosting the store (TRL's layout: the trainer last, it never
    joins) or connected to the trainer's store (the trainer never forms its group). The
    join's own timeout (60 s) is far beyond the deadline."""
    port = free_port()
    engine = GlooEngine(torch.device("cpu"))
    init = {"master_address": "127.0.0.1", "master_port": port, "world_size": 2,
            "timeout_s": 60}  # fmt: skip
    if engine_hosts_store:
        init |= {"trainer_rank": 1, "rank_offset": 0}
        joining = _in_thread(lambda: engine.init_transfer_engine(init))
        wait_until(lambda: _accepts(port), "the engine's store listens")
    else:
        trainer_store = dist.TCPStore("127.0.0.1", port, 2, is_master=True,
                                      timeout=datetime.timedelta(seconds=60),
                                      wait_for_workers=False)  # fmt: skip
        joining = _in_thread(lambda: engine.init_transfer_engine(init))
        # A connected client shows as a key (torch's join counter) in the host's store.
        wait_until(lambda: trainer_store.num_keys() > 0, "the engine connected to the store")
    cancelled_at = time.monotonic()
    engine.cancel.set()
    with pytest.raises(RendezvousCancelled):
        joining.result(timeout=5)
    assert time.monotonic() - cancelled_at < 2
    assert engine.channel is None
    if engine_hosts_store:  # the store was closed with the join: its port is free again
        wait_until(lambda: not _accepts(port), "the engine's store is closed")


@pytest.mark.slow
def test_silent_trainer_round_is_aborted_and_generation_resumes(gloo_server, v2_trainer):
    """round_timeout_s is 3 s on this server: a round started and then left silent stops
    generation only that long; then a new trainer's init is accepted."""
    client = HTTPWeightSyncClient(gloo_server.url)
    info = GlooTrainerInitInfo(master_port=free_port(), world_size=2, timeout_s=30)
    WeightTransferTrainerFactory.trainer_init(info, client, ModuleSource(v2_trainer))
    before = weight_state(gloo_server)
    with gloo_server.client() as http:
        assert http.post("/start_weight_update").status_code == 200
        start = time.perf_counter()
        assert _complete(http).status_code == 200  # waits for the round to be aborted
        waited = time.perf_counter() - start
        assert 2.0 < waited < 10.0, waited
        assert_unharmed(gloo_server, http, before)
    _send(gloo_server, v2_trainer)


@pytest.mark.slow
def test_master_address_not_allowed_is_400(gloo_server) -> None:
    before = weight_state(gloo_server)
    init = {"init_info": {"master_address": "192.0.2.1", "master_port": 29500,
                          "world_size": 2}}  # fmt: skip
    with gloo_server.client(timeout=10) as client:
        r = client.post("/init_weight_transfer_engine", json=init)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "body.init_info.master_address"
        assert_unharmed(gloo_server, client, before)


def _listening(port: int) -> set[str]:
    """Local addresses (hex, as /proc/net/tcp* print them) listening on `port`."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, _, hex_port = local.partition(":")
            if state == "0A" and int(hex_port, 16) == port:
                found.add(address)
    return found


def test_store_listens_only_on_the_named_address() -> None:
    port = free_port()
    groups: dict[int, object] = {}
    cpu = torch.device("cpu")

    def join(rank: int) -> None:
        groups[rank] = join_group("127.0.0.1", port, rank, 2, cpu, 30)

    threads = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert set(groups) == {0, 1}
    assert _listening(port) == {"0100007F"}  # 127.0.0.1, not 0.0.0.0 or [::]


@pytest.mark.parametrize(
    ("address", "allowed", "ok"),
    [
        ("127.0.0.1", ("127.0.0.1",), True),
        ("localhost", ("127.0.0.1",), True),
        ("127.0.0.5", ("127.0.0.0/8",), True),
        ("10.0.0.1", ("127.0.0.0/8", "localhost"), False),
        ("no-such-host.invalid", ("127.0.0.1",), False),
    ],
)
def test_address_allow_list(address: str, allowed: tuple[str, ...], ok: bool) -> None:
    from hotswap.weight_transfer.engine import address_allowed

    assert address_allowed(address, allowed) is ok
