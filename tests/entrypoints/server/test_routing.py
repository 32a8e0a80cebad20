"""Data-parallel routing over HTTP (hotswap/entrypoints/server/routing.py): a session's
requests, named by vLLM router's X-Session-ID header, the body's session_id or SGLang's
routing_key, go to one rank; vLLM's X-data-parallel-rank pins one; bad hints are a 400
naming the header or field. Checked on a two-rank server through /metrics' per-rank
routing counters, with the openai client and httpx."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.entrypoints.openai.conftest import SERVER_ARGS
from tests.helpers.server import RemoteServer

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_ranks(tiny_llama: Path) -> Iterator[RemoteServer]:
    srv = RemoteServer(tiny_llama, *SERVER_ARGS, "--data-parallel-size", "2")
    try:
        yield srv
    finally:
        srv.stop()


def routed(server: RemoteServer) -> list[int]:
    """Requests sent to each rank so far (hotswap:dp_routed_requests)."""
    with server.client() as http:
        text = http.get("/metrics").text
    found = re.findall(r'hotswap:dp_routed_requests_total\{.*rank="(\d)"\} (\S+)', text)
    return [int(float(count)) for _, count in sorted(found)]


def delta(before: list[int], after: list[int]) -> list[int]:
    return [a - b for a, b in zip(after, before, strict=True)]


LONG = {"model": "tiny", "prompt": "busy", "max_tokens": 400, "ignore_eos": True, "stream": True}


def test_a_sessions_requests_go_to_its_rank_though_it_is_busier(
    two_ranks: RemoteServer,
) -> None:
    """Each turn of a session goes where its first went, while a long request keeps that
    rank busier than the other (least-loaded routing would send the turns there)."""
    client = openai.OpenAI(base_url=f"{two_ranks.url}/v1", api_key="unused")
    spellings = {
        "X-Session-ID": lambda turn: client.completions.create(
            model="tiny", prompt=f"turn {turn}", max_tokens=2,
            extra_headers={"X-Session-ID": "s-1"}),
        "session_id": lambda turn: client.completions.create(
            model="tiny", prompt=f"turn {turn}", max_tokens=2, extra_body={"session_id": "s-2"}),
        "routing_key": lambda turn: _sglang_turn(two_ranks, turn),
    }  # fmt: skip
    for spelling, turn in spellings.items():
        before = routed(two_ranks)
        turn(0)
        rank = delta(before, routed(two_ranks)).index(1)
        with (
            two_ranks.client() as http,
            http.stream(
                "POST", "/v1/completions", json=LONG, headers={"X-data-parallel-rank": str(rank)}
            ) as busy,
        ):
            next(busy.iter_lines())  # admitted: the session's rank holds one more request
            for i in range(1, 4):
                turn(i)
        counts = delta(before, routed(two_ranks))
        assert counts[rank] == 5 and counts[1 - rank] == 0, (spelling, counts)
    with two_ranks.client() as http:
        text = http.get("/metrics").text
    rates = re.findall(r'hotswap:dp_prefix_cache_hit_rate\{.*rank="(\d)"\} (\S+)', text)
    assert [rank for rank, _ in rates] == ["0", "1"] and all(0 <= float(r) <= 1 for _, r in rates)


def _sglang_turn(server: RemoteServer, turn: int) -> None:
    body = {"text": f"turn {turn}", "routing_key": "s-3", "sampling_params": {"max_new_tokens": 2}}
    with server.client() as http:
        assert http.post("/generate", json=body).status_code == 200


def test_an_explicit_rank_wins_and_bad_hints_are_refused(two_ranks: RemoteServer) -> None:
    before = routed(two_ranks)
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
    with two_ranks.client() as http:
        for rank in (1, 1, 0):
            headers = {"X-data-parallel-rank": str(rank), "X-Session-ID": "pinned"}
            assert http.post("/v1/completions", json=body, headers=headers).status_code == 200
        assert delta(before, routed(two_ranks)) == [1, 2]
        kept = {**body, "kv_retention_s": 30}  # a session's turn kept for its next
        assert http.post("/v1/completions", json=kept, headers=headers).status_code == 200
        stats = http.get("/metrics").text
        assert re.search(r"^hotswap:prefix_cache_hit_rate", stats, re.M)
        before = routed(two_ranks)
        refusals = [
            ({"X-data-parallel-rank": "2"}, body, "X-data-parallel-rank"),
            ({"X-Session-ID": "x" * 257}, body, "X-Session-ID"),
            ({}, {**body, "session_id": ""}, "body.session_id"),
            ({}, {**body, "kv_retention_s": -1}, "body.kv_retention_s"),
        ]
        for headers, sent, param in refusals:
            r = http.post("/v1/completions", json=sent, headers=headers)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        sglang = {"text": "hi", "data_parallel_rank": 5, "sampling_params": {"max_new_tokens": 1}}
        r = http.post("/generate", json=sglang)
        assert r.status_code == 400 and "data_parallel_rank" in r.text, r.text
    assert delta(before, routed(two_ranks)) == [0, 0]  # nothing refused was admitted
