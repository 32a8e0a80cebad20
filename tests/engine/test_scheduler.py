"""Scheduler behaviour with fake model outputs (no model runs)."""

from __future__ import annotations

import pytest

from hotswap.config import CacheConfig, SchedulerConfig
from hotswap.engine.request import Request, RequestStatus
from hotswap.engine.scheduler import PauseState, Scheduler, SchedulerOutput

EOS = 0


def make_scheduler(
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 32,
    max_seqs: int = 8,
    chunked: bool = True,
    max_len: int = 256,
    prefill_cap: int | None = None,
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(
            max_num_seqs=max_seqs,
            max_num_batched_tokens=budget,
            max_prefill_tokens_while_decoding=prefill_cap,
            enable_chunked_prefill=chunked,
            max_model_len=max_len,
        ),
        CacheConfig(block_size=block_size),
        num_blocks,
    )


def make_request(rid: str, prompt_len: int, max_tokens: int = 4, first: int = 1, **kw) -> Request:
    from hotswap.sampling_params import SamplingParams

    prompt = [first + i for i in range(prompt_len)]
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **kw), eos_token_id=EOS)


def fake_step(sched: Scheduler, token: int = 7) -> SchedulerOutput:
    out = sched.schedule()
    sampled = {s.request.request_id: token for s in out.scheduled if s.samples}
    sched.update_from_output(out, sampled)
    return out


def run_to_completion(sched: Scheduler, max_steps: int = 500) -> int:
    steps = 0
    while sched.has_unfinished_requests():
        fake_step(sched)
        steps += 1
        assert steps < max_steps, "scheduler made no progress"
    return steps


def test_prefill_and_decode_mix_in_one_step() -> None:
    sched = make_scheduler(budget=16)
    a = make_request("a", 5)
    sched.add_request(a)
    fake_step(sched)  # a: prefill of 5 tokens
    sched.add_request(make_request("b", 8, first=100))
    out = sched.schedule()
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [("a", 1), ("b", 8)]


def test_prefill_is_capped_only_while_requests_decode() -> None:
    sched = make_scheduler(budget=32, prefill_cap=4)
    sched.add_request(make_request("a", 10))
    sched.add_request(make_request("b", 6, first=50))
    out = sched.schedule()  # nobody decodes yet: the whole budget goes to prefill
    assert [(s.request.request_id, s.num_tokens) for s in out.scheduled] == [("a", 10), ("b", 6)]
    sched.update_from_output(out, {"a": 7, "b": 7})
    sched.add_request(make_request("c", 9, first=100))
    sched.add_request(make_request("d", 9, first=150))
    steps = []
    for _ in range(3):
        out = fake_step(sched)
        steps.append([(s.request.request_id, s.num_tokens) for s in out.scheduled])
    # a and b decode every step; the new prompts are fed at most 4 tokens a step.
    assert steps[0] == [("a", 1), ("b", 1), ("c", 4)]
    assert steps[1] == [("a", 1), ("b", 1), ("c", 4)]
    assert steps[2] == [("a", 1), ("b", 1), ("c", 1), ("d", 4)]  # a 1-token rest is no burst
    run_to_completion(sched)
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks


def test_chunked_prefill_respects_budget_and_samples_only_at_end() -> None:
    sched = make_scheduler(budget=8)
    r = make_request("r", 20)
    sched.add_request(r)
    chunks = []
    for _ in range(3):
        out = fake_step(sched)
        chunks.append((out.scheduled[0].num_tokens, out.scheduled[0].samples))
    assert chunks == [(8, False), (8, False), (4, True)]
    assert r.num_computed_tokens == 20 and r.output_token_ids == [7]


def test_without_chunked_prefill_a_long_prompt_waits_for_a_full_budget() -> None:
    sched = make_scheduler(budget=10, chunked=False)
    sched.add_request(make_request("a", 4, max_tokens=3))
    sched.add_request(make_request("b", 9, first=100))
    out = sched.schedule()
    assert [s.request.request_id for s in out.scheduled] == ["a"]


def test_max_num_seqs_limits_running() -> None:
    sched = make_scheduler(max_seqs=2)
    for i in range(3):
        sched.add_request(make_request(str(i), 3))
    out = sched.schedule()
    assert len(out.scheduled) == 2 and sched.num_waiting == 1


def test_finish_on_length_eos_and_stop_token() -> None:
    sched = make_scheduler()
    length = make_request("len", 3, max_tokens=2)
    eos = make_request("eos", 3, max_tokens=10)
    stop = make_request("stop", 3, max_tokens=10, stop_token_ids=[9])
    for r in (length, eos, stop):
        sched.add_request(r)
    out = sched.schedule()
    sched.update_from_output(out, {"len": 5, "eos": EOS, "stop": 9})
    assert eos.status == RequestStatus.FINISHED_STOPPED and eos.stop_reason is None
    assert stop.status == RequestStatus.FINISHED_STOPPED and stop.stop_reason == 9
    fake_step(sched)
    assert length.status == RequestStatus.FINISHED_LENGTH and length.num_output_tokens == 2
    assert sched.kv.num_free_blocks == 64


def test_min_tokens_and_ignore_eos_defer_stopping() -> None:
    sched = make_scheduler()
    early = make_request("min", 3, max_tokens=5, min_tokens=2)
    ignore = make_request("ign", 3, max_tokens=3, ignore_eos=True)
    sched.add_request(early)
    sched.add_request(ignore)
    for _ in range(2):
        fake_step(sched, token=EOS)
    assert early.status == RequestStatus.FINISHED_STOPPED and early.num_output_tokens == 2
    fake_step(sched, token=EOS)
    assert ignore.status == RequestStatus.FINISHED_LENGTH


def test_max_model_len_caps_generation() -> None:
    sched = make_scheduler(max_len=10)
    r = make_request("r", 8, max_tokens=100)
    sched.add_request(r)
    run_to_completion(sched)
    assert r.num_tokens == 10 and r.status == RequestStatus.FINISHED_LENGTH


def test_prompt_too_long_is_refused_and_nothing_is_queued() -> None:
    sched = make_scheduler(max_len=10)
    with pytest.raises(ValueError, match="max_model_len=10"):
        sched.add_request(make_request("r", 10))
    assert not sched.has_unfinished_requests()


def test_preemption_by_recompute_when_blocks_run_out() -> None:
    # 6 blocks of 4 tokens: two requests of 8 prompt tokens + 8 outputs cannot both fit.
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64)
    a = make_request("a", 8, max_tokens=8)
    b = make_request("b", 8, max_tokens=8, first=100)
    sched.add_request(a)
    sched.add_request(b)
    preempted = []
    while sched.has_unfinished_requests():
        out = fake_step(sched)
        preempted.extend(r.request_id for r in out.preempted)
    assert preempted and preempted[0] == "b"  # the newest is preempted first
    assert a.num_output_tokens == 8 and b.num_output_tokens == 8
    assert b.num_preemptions >= 1 and sched.kv.num_free_blocks == 6


def test_prefix_cache_hit_is_recorded_once() -> None:
    sched = make_scheduler(block_size=4)
    sched.add_request(make_request("a", 10, max_tokens=1))
    run_to_completion(sched)
    b = make_request("b", 12, max_tokens=1)
    sched.add_request(b)
    out = sched.schedule()
    assert b.num_cached_tokens == 8 and out.scheduled[0].num_tokens == 4


def test_abort_frees_blocks_wherever_the_request_is() -> None:
    sched = make_scheduler(max_seqs=1)
    running, waiting = make_request("run", 6), make_request("wait", 6)
    sched.add_request(running)
    sched.add_request(waiting)
    fake_step(sched)
    finished = sched.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert {r.request_id for r in finished} == {"run", "wait"}
    assert running.status.finish_reason == "abort"
    assert not sched.has_unfinished_requests() and sched.kv.num_free_blocks == 64


def test_duplicate_request_id_is_refused() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("r", 3))
    with pytest.raises(ValueError, match="already in use"):
        sched.add_request(make_request("r", 3))


class TestPauseStates:
    def test_paused_all_schedules_nothing_and_keeps_state(self) -> None:
        sched = make_scheduler()
        r = make_request("r", 4, max_tokens=10)
        sched.add_request(r)
        fake_step(sched)
        sched.set_pause_state(PauseState.PAUSED_ALL)
        assert sched.schedule().is_empty
        assert r.status == RequestStatus.RUNNING and r.num_output_tokens == 1
        sched.set_pause_state(PauseState.UNPAUSED)
        fake_step(sched)
        assert r.num_output_tokens == 2

    def test_paused_new_runs_running_but_admits_no_new(self) -> None:
        sched = make_scheduler()
        running = make_request("run", 4, max_tokens=3)
        sched.add_request(running)
        fake_step(sched)
        sched.set_pause_state(PauseState.PAUSED_NEW)
        new = make_request("new", 4)
        sched.add_request(new)
        run_steps = 0
        while running.status == RequestStatus.RUNNING:
            out = fake_step(sched)
            assert all(s.request is running for s in out.scheduled)
            run_steps += 1
        assert running.status == RequestStatus.FINISHED_LENGTH and run_steps == 2
        assert sched.schedule().is_empty and new.status == RequestStatus.WAITING
        sched.set_pause_state(PauseState.UNPAUSED)
        assert [s.request for s in sched.schedule().scheduled] == [new]

    def test_paused_new_still_readmits_preempted_requests(self) -> None:
        """A request preempted while paused-new was running: `wait` must see it finish."""
        sched = make_scheduler(num_blocks=6, block_size=4, budget=64)
        a = make_request("a", 8, max_tokens=8)
        b = make_request("b", 8, max_tokens=8, first=100)
        sched.add_request(a)
        sched.add_request(b)
        fake_step(sched)
        sched.set_pause_state(PauseState.PAUSED_NEW)
        fresh = make_request("fresh", 4)
        sched.add_request(fresh)
        while a.status == RequestStatus.RUNNING or b.status in (
            RequestStatus.RUNNING,
            RequestStatus.PREEMPTED,
        ):
            fake_step(sched)
        assert b.num_preemptions >= 1
        assert a.num_output_tokens == 8 and b.num_output_tokens == 8
        assert fresh.status == RequestStatus.WAITING


def test_make_room_preempts_the_newest_until_enough_blocks_are_free() -> None:
    sched = make_scheduler(num_blocks=12, block_size=4, budget=64)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", 12, max_tokens=8, first=10 * i + 1))
    fake_step(sched)  # each holds 3 blocks
    assert sched.kv.num_free_blocks == 3
    sched.make_room(8)
    assert [r.request_id for r in sched.running] == ["r0"]  # r2, then r1, preempted
    assert sched.kv.num_free_blocks == 9
    assert all(r.status == RequestStatus.PREEMPTED for r in sched.waiting)
    sched.make_room(9)  # already free: nobody else goes
    assert len(sched.running) == 1
    run_to_completion(sched)  # the preempted ones recompute and finish
