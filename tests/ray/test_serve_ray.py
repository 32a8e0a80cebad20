"""`hotswap serve --data-parallel-backend ray`: the data-parallel engine cores as Ray actors
behind one server, end to end (the server starts its own local Ray and stops it on exit),
and the backend's validation."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections import defaultdict
from pathlib import Path

import httpx
import pytest

from hotswap import LLM, AsyncLLM, SamplingParams
from hotswap.engine_args import EngineArgs
from hotswap.entrypoints.cli import build_parser, engine_kwargs
from hotswap.errors import InvalidArgument
from tests.helpers.server import RemoteServer
from tests.helpers.waiting import requests_waiting, until, wait_until

pytest.importorskip("ray")

MODEL = "tiny"
SERVER_ARGS = (
    "--served-model-name", MODEL, "--dtype", "float32", "--max-model-len", "256",
    "--num-kv-blocks", "64", "--enable-control", "--data-parallel-backend", "ray",
    "--data-parallel-size", "2", "--worker-extension-cls", "tests.ray.rank_probe:RankProbe",
)  # fmt: skip
PROMPTS = [f"request {i} of a data-parallel batch" for i in range(6)]
GREEDY = dict(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def server(tiny_llama: Path):
    srv = RemoteServer(tiny_llama, *SERVER_ARGS)
    try:
        yield srv
    finally:
        srv.stop()  # a no-op once the last test stopped it


def completion(prompt: str, **params: object) -> dict:
    return {"model": MODEL, "prompt": prompt, **GREEDY, **params}


def probe(client: httpx.Client) -> list[dict]:
    """Each rank's process id and forward-pass count (tests/ray/rank_probe.py)."""
    r = client.post("/collective_rpc", json={"method": "probe"})
    assert r.status_code == 200, r.text
    return sorted(r.json()["results"], key=lambda p: p["rank"])


def descendants(pid: int) -> set[int]:
    """Every live process below `pid` (from /proc)."""
    children: dict[int, list[int]] = defaultdict(list)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            children[int(stat.rpartition(")")[2].split()[1])].append(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children[todo.pop()]:
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


async def _holding(http: httpx.AsyncClient, count: int) -> bool:
    """Whether the ranks hold `count` requests, waiting (paused), between them."""
    return await requests_waiting(http) == count


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_actor_ranks_answer_as_one_engine(server: RemoteServer, tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", progress=False)
    outputs = llm.generate(PROMPTS, SamplingParams(**GREEDY), use_tqdm=False)
    expected = [o.outputs[0].text for o in outputs]

    async def complete_all() -> list[str]:
        async with server.async_client() as http:
            replies = await asyncio.gather(
                *(http.post("/v1/completions", json=completion(p)) for p in PROMPTS)
            )
        return [r.json()["choices"][0]["text"] for r in replies]

    with server.client() as client:
        before = probe(client)
        ranks = [p["pid"] for p in before]
        assert [p["rank"] for p in before] == [0, 1] and len(set(ranks)) == 2
        # Ray actors of the server's own Ray, not child processes of the server.
        assert set(ranks) <= descendants(server.proc.pid)
        for pid in ranks:
            assert b"EngineCoreActor" in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert asyncio.run(complete_all()) == expected
        after = probe(client)
        assert all(a["forwards"] > b["forwards"] for a, b in zip(after, before, strict=True))
        assert "hotswap:generation_tokens_total" in client.get("/metrics").text


@pytest.mark.slow
def test_pause_holds_a_request_on_each_rank_until_resume(server: RemoteServer) -> None:
    async def scenario() -> None:
        async with server.async_client() as http:
            assert (await http.post("/pause", params={"mode": "keep"})).status_code == 200
            assert (await http.get("/is_paused")).json() == {"is_paused": True}
            # Least loaded first: the first request goes to rank 0, the second to rank 1.
            tasks = [
                asyncio.ensure_future(http.post("/v1/completions", json=completion(p)))
                for p in PROMPTS[:2]
            ]
            await until(lambda: _holding(http, 2), "the ranks hold both requests")
            assert not any(task.done() for task in tasks)
            assert (await http.post("/resume")).status_code == 200
            replies = await asyncio.wait_for(asyncio.gather(*tasks), 30)
            assert [r.status_code for r in replies] == [200, 200]
            assert all(r.json()["choices"][0]["finish_reason"] == "length" for r in replies)
            assert (await http.get("/is_paused")).json() == {"is_paused": False}

    asyncio.run(scenario())


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_rank_fails_pending_requests_and_ray_stops_with_the_server(
    server: RemoteServer,
) -> None:
    """Runs last in this module: it leaves the server's engine dead, then stops it."""
    with server.client() as client:
        victim = probe(client)[1]["pid"]
    ray_processes = descendants(server.proc.pid)

    async def scenario() -> None:
        async with server.async_client() as http:
            assert (await http.post("/pause", params={"mode": "keep"})).status_code == 200
            tasks = [
                asyncio.ensure_future(http.post("/v1/completions", json=completion(p)))
                for p in PROMPTS[:2]
            ]
            await until(lambda: _holding(http, 2), "one request is held on each rank")
            os.kill(victim, signal.SIGKILL)
            started = time.monotonic()
            replies = await asyncio.wait_for(asyncio.gather(*tasks), 10)
            assert time.monotonic() - started < 5
            for reply in replies:
                assert reply.status_code == 503, reply.text
                assert "rank 1" in reply.json()["error"]["message"]
            assert (await http.get("/health")).status_code == 503

    asyncio.run(scenario())
    assert server.stop() == 0
    wait_until(
        lambda: not any(alive(pid) for pid in ray_processes), "Ray stopped with the server", 15
    )


# -- validation (no Ray started) -----------------------------------------------------------
def test_backend_is_validated(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def config(**kwargs: object) -> None:
        EngineArgs(model=str(tiny_llama), **kwargs).create_engine_config()  # type: ignore[arg-type]

    with pytest.raises(InvalidArgument, match="unknown 'foo'; choose from mp, ray") as e:
        config(data_parallel_backend="foo")
    assert e.value.field == "data_parallel_backend"
    with pytest.raises(InvalidArgument, match="ray_address: must be") as e:
        config(data_parallel_backend="ray", ray_address="")
    assert e.value.field == "ray_address"
    config(data_parallel_backend="ray", ray_address="auto")  # looked up, nothing started
    monkeypatch.setitem(sys.modules, "ray", None)  # as if Ray were not installed
    with pytest.raises(InvalidArgument, match=r"pip install 'hotswap\[ray\]'") as e:
        config(data_parallel_backend="ray")
    assert e.value.field == "data_parallel_backend"
    config(data_parallel_backend="mp")


def test_ray_backend_needs_an_out_of_process_engine(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="data_parallel_backend: engine cores run in"):
        AsyncLLM(str(tiny_llama), data_parallel_backend="ray", progress=False)
    with pytest.raises(ValueError, match="data_parallel_backend: LLM runs its engine core"):
        LLM(str(tiny_llama), data_parallel_backend="ray", progress=False)


def test_cli_flags() -> None:
    args = build_parser().parse_args(
        ["serve", "--data-parallel-backend", "ray", "--ray-address", "ray://head:10001"]
    )
    kwargs = engine_kwargs(args)
    assert kwargs["data_parallel_backend"] == "ray"
    assert kwargs["ray_address"] == "ray://head:10001"
    defaults = engine_kwargs(build_parser().parse_args(["serve"]))
    assert (defaults["data_parallel_backend"], defaults["ray_address"]) == ("mp", None)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--data-parallel-backend", "foo"])


def test_each_actor_rank_gets_its_own_bundle_and_device() -> None:
    from hotswap.ray.dp import rank_resources, ray_rank_args

    gpu = ray_rank_args(EngineArgs(device="cuda:1", data_parallel_size=2), 1)
    assert (gpu.device, gpu.num_threads, gpu.data_parallel_rank) == ("cuda:0", 1, 1)
    assert gpu.data_parallel_size == 1
    assert rank_resources(gpu) == {"CPU": 1.0, "GPU": 1.0}
    cpu = ray_rank_args(EngineArgs(num_threads=3, data_parallel_size=2), 0)
    assert (cpu.device, rank_resources(cpu)) == ("cpu", {"CPU": 3.0})


def test_actor_sockets_listen_on_the_node_ip_for_the_key_holder_only() -> None:
    """A peer that reaches the TCP port without the front-end's key gets no share of what
    the input socket deals out; the actor, given the key, does."""
    import ray
    import zmq

    from hotswap.ray.dp import EngineCoreActor, RayCoreRunner

    runner = RayCoreRunner(ray.remote(EngineCoreActor), {})
    context = zmq.Context()
    push, pull = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    try:
        input_addr, output_addr = runner.bind(push, pull)
        host = ray.util.get_node_ip_address()
        assert input_addr.startswith(f"tcp://{host}:") and output_addr.startswith(f"tcp://{host}:")
        stranger = context.socket(zmq.PULL)
        stranger.connect(input_addr)
        assert not push.poll(500, zmq.POLLOUT)  # no peer: the stranger failed the handshake
        actor = context.socket(zmq.PULL)
        actor.curve_serverkey = runner.server_key
        actor.curve_publickey, actor.curve_secretkey = zmq.curve_keypair()
        actor.connect(input_addr)
        assert push.poll(5000, zmq.POLLOUT)
        for i in range(4):
            push.send(b"%d" % i)
        assert [actor.recv() for _ in range(4)] == [b"0", b"1", b"2", b"3"]
        assert not stranger.poll(200)
    finally:
        context.destroy(linger=0)
