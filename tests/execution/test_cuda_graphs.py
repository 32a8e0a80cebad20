"""The decode graphs' logic on the CPU: an engine on the Triton kernels (under Triton's
interpreter) whose decode steps replay graphs recorded by the stand-in of
tests/helpers/graph_recorder.py, which bakes in what a CUDA graph bakes in (sizes, host
values, the addresses of every input) and refuses a stale input. Each test compares with
the same engine run eagerly."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import pytest
import torch

from hotswap import LLM, AsyncLLM, SamplingParams
from hotswap.execution.cuda_graphs import DecodeGraphs, capture_sizes
from hotswap.execution.decode_paths import watched_tensors
from hotswap.execution.runner import ModelRunner
from hotswap.weight_transfer import (
    GlooTrainerInitInfo,
    InProcessWeightSyncClient,
    ModuleSource,
    WeightTransferTrainerFactory,
)
from tests.helpers.graph_recorder import RecordingCapture, StaleGraphError
from tests.helpers.recording import record_logits
from tests.model.cuda.conftest import DEVICE
from tests.weight_transfer.conftest import free_port, trainer_model

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="the CPU stand-in of CUDA graphs")
slow = pytest.mark.slow  # engines on Triton's interpreter: seconds per step

PROMPTS = ["The quick brown", "Pause, swap the weights, resume", "x", "0123456789 and sym",
           "Paged attention stores keys and values in blocks. " * 3]  # fmt: skip
# staggered lengths: the batch shrinks 5 -> 1 over the run, through buckets 8, 4, 2, 1
LENGTHS = [2, 4, 6, 8, 10]


def engine(path: Path, **kwargs) -> LLM:  # noqa: ANN003
    return LLM(str(path), dtype="float32", attention_backend="TRITON_ATTN", progress=False,
               max_num_seqs=8, **kwargs)  # fmt: skip


def with_recorded_graphs(llm: LLM | None, runner: ModelRunner | None = None) -> DecodeGraphs:
    """The stand-in's graphs on `llm`'s runner (or `runner`), every bucket captured (as at
    start)."""
    runner = runner or llm.engine.runner
    runner.graphs = DecodeGraphs(
        runner.model, RecordingCapture(), watched_tensors(runner.model, lambda: runner.kv_caches),
        functools.partial(runner.backend.graph_metadata, block_size=runner.block_size),
        max_rows=8, max_blocks=-(-512 // runner.block_size), device=runner.device,
    )  # fmt: skip
    with torch.inference_mode():
        runner.graphs.capture_all(progress=False)
    return runner.graphs


def generate(llm: LLM) -> list:
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1)
              for n in LENGTHS]  # fmt: skip
    return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def assert_same(got: list, want: list) -> None:
    for a, b in zip(got, want, strict=True):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.keys() == y.keys()
            assert max(abs(x[t].logprob - y[t].logprob) for t in x) < 1e-5


@pytest.fixture(scope="module")
def eager_outputs(tiny_model_factory) -> list:  # noqa: ANN001
    llm = engine(tiny_model_factory("qwen3"))
    outputs = generate(llm)
    llm.shutdown()
    return outputs


def test_capture_sizes_cover_every_batch_up_to_the_limit() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(10_000)[-3:] == [496, 504, 512]


@slow
def test_replayed_decode_steps_give_the_eager_tokens(tiny_model_factory, eager_outputs) -> None:  # noqa: ANN001
    llm = engine(tiny_model_factory("qwen3"))
    graphs = with_recorded_graphs(llm)
    assert sorted(graphs.graphs) == [1, 2, 4, 8] and graphs.captures == 4  # at start
    assert_same(generate(llm), eager_outputs)
    assert graphs.graph_steps >= max(LENGTHS) - 2  # every decode step but none of prefill
    assert graphs.captures == 4 and graphs.recaptures == 0
    assert graphs.eager_steps["prefill"] >= 1
    assert all(g.replays for g in graphs.capturer.graphs)  # each bucket replayed
    llm.shutdown()


@slow
def test_a_mixture_of_experts_replays_through_the_fused_experts(tiny_model_factory) -> None:  # noqa: ANN001
    """The routed experts grouped on the device: nothing read back, so a decode step with
    experts replays from a graph (the stand-in would have baked in any host value)."""
    path = tiny_model_factory("qwen3_moe")
    eager = engine(path)
    want = generate(eager)
    assert eager.engine.runner.model.graphable
    eager.shutdown()
    llm = engine(path)
    graphs = with_recorded_graphs(llm)
    assert_same(generate(llm), want)
    assert graphs.graph_steps > 0
    llm.shutdown()


@slow
def test_fp8_weights_and_kv_cache_replay_from_graphs(tiny_model_factory) -> None:  # noqa: ANN001
    """--quantization fp8 and --kv-cache-dtype fp8 on the Triton kernels: the FP8 GEMM and
    the codes' store and reads read nothing back, so their decode steps replay."""
    kwargs = {"quantization": "fp8", "kv_cache_dtype": "fp8", "hf_overrides": {
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [16, 16]}}}  # fmt: skip
    path = tiny_model_factory("qwen3")
    eager = engine(path, **kwargs)
    want = generate(eager)
    eager.shutdown()
    llm = engine(path, **kwargs)
    graphs = with_recorded_graphs(llm)
    assert_same(generate(llm), want)
    assert graphs.graph_steps > 0 and graphs.recaptures == 0
    llm.shutdown()


@slow
def test_batch_invariant_graphs_give_the_eager_logits_bit_for_bit(tiny_model_factory) -> None:  # noqa: ANN001
    """Every row through the prefill kernel, its tile aligned to its position: a padded,
    replayed decode step gives the very logits the eager step gives."""
    logits = []
    for graphed in (False, True):
        llm = engine(tiny_model_factory("qwen3"), batch_invariant=True)
        graphs = with_recorded_graphs(llm) if graphed else None
        recorder = record_logits(llm)
        generate(llm)
        logits.append(recorder.logits)
        llm.shutdown()
    assert graphs is not None and graphs.graph_steps > 0
    assert logits[0].keys() == logits[1].keys()
    for request_id, steps in logits[0].items():
        assert torch.equal(torch.stack(steps), torch.stack(logits[1][request_id]))


@slow
def test_a_wake_from_sleep_recaptures_and_a_stale_graph_never_runs(
    tiny_model_factory, eager_outputs, monkeypatch
) -> None:  # noqa: ANN001
    llm = engine(tiny_model_factory("qwen3"), enable_sleep_mode=True)
    graphs = with_recorded_graphs(llm)
    generate(llm)
    llm.call("sleep", level=1)  # weights to the host and back, KV cache re-allocated
    llm.call("wake_up")
    assert graphs.graphs == {}  # sleep dropped them with the KV cache
    assert_same(generate(llm), eager_outputs)
    assert graphs.captures == 8
    # Graphs kept across a sleep (as if sleep had not dropped them) are caught by their
    # addresses before they run ...
    monkeypatch.setattr(DecodeGraphs, "release", lambda self: None)
    llm.call("sleep", level=1)
    llm.call("wake_up")
    assert_same(generate(llm), eager_outputs)
    assert graphs.recaptures == 4 and graphs.captures == 12  # each bucket's graph, on use
    # ... and without that check the stand-in refuses them as a GPU would read freed memory
    monkeypatch.setattr(DecodeGraphs, "fingerprint", lambda self: ())
    generate(llm)  # every graph recaptured once more, now under the blind fingerprint
    llm.call("sleep", level=1)
    llm.call("wake_up")
    with pytest.raises(StaleGraphError):
        generate(llm)


@slow
def test_weights_written_in_place_keep_the_graphs(tiny_model_factory) -> None:  # noqa: ANN001
    new_weights = tiny_model_factory("qwen3", seed=1)
    reference = engine(new_weights)
    want = generate(reference)
    reference.shutdown()
    llm = engine(tiny_model_factory("qwen3"), allowed_weight_dirs=[str(new_weights.parent)])
    graphs = with_recorded_graphs(llm)
    generate(llm)
    captures = graphs.captures
    llm.call("load_weights_from_disk", model_path=str(new_weights))
    assert_same(generate(llm), want)
    assert graphs.captures == captures and graphs.recaptures == 0


@slow
def test_a_double_buffered_commit_copies_into_the_captured_weights(tiny_model_factory) -> None:  # noqa: ANN001
    llm = engine(tiny_model_factory("qwen3"))
    runner = llm.engine.runner
    graphs = with_recorded_graphs(llm)
    generate(llm)
    name = "model.norm.weight"
    param = runner.model.parameter_index()[name]
    address = param.data_ptr()
    view = runner.rank_shadow().destination(param.data, name)
    view.fill_(0.5)
    runner.swap_shadow()
    assert param.data_ptr() == address and torch.equal(param.data, torch.full_like(param, 0.5))
    generate(llm)
    assert graphs.recaptures == 0
    param.data = param.data.clone()  # what a swap would do: the stand-in refuses to replay
    with torch.inference_mode(), pytest.raises(StaleGraphError, match="moved"):
        graphs.graphs[1].graph.replay()
    llm.shutdown()


async def _swap_mid_flight(llm: AsyncLLM, trainer, prompts: list[str], max_tokens: int) -> list:  # noqa: ANN001
    """Greedy streams; once one has 5 tokens: pause (keep, clear_cache), a round from the
    trainer, resume."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    latest: dict[int, object] = {}
    reached = asyncio.Event()

    async def stream(i: int) -> None:
        async for out in llm.generate(prompts[i], params, request_id=f"r{i}"):
            latest[i] = out.outputs[0]
            if len(latest[i].token_ids) >= 5:
                reached.set()

    tasks = [asyncio.ensure_future(stream(i)) for i in range(len(prompts))]
    await asyncio.wait_for(reached.wait(), 300)
    await llm.pause_generation(mode="keep", clear_cache=True)
    await asyncio.to_thread(trainer.send_weights, "v2")
    await llm.resume_generation()
    await asyncio.wait_for(asyncio.gather(*tasks), 600)
    return [latest[i] for i in range(len(prompts))]


@slow
def test_a_mid_flight_swap_with_graphs_matches_a_fresh_engine(tiny_model_factory) -> None:  # noqa: ANN001
    """Batch-invariant float32 on the Triton kernels, decode steps replayed from graphs: the
    round writes the weights in place (the graphs stay), and every token after the resume
    equals a fresh V2 engine's continuation of the request's context."""
    v1, v2 = tiny_model_factory("llama", seed=0), tiny_model_factory("llama", seed=1)
    prompts, max_tokens = PROMPTS[:4], 12
    kwargs = {"dtype": "float32", "batch_invariant": True, "block_size": 8, "progress": False,
              "attention_backend": "TRITON_ATTN", "max_num_seqs": 8}  # fmt: skip

    async def run() -> tuple[list, list, DecodeGraphs]:
        llm = AsyncLLM(str(v1), weight_transfer_config={"backend": "gloo"}, **kwargs)
        try:
            await llm.get_weight_version()
            graphs = with_recorded_graphs(None, llm.client.core.runner)
            info = GlooTrainerInitInfo(master_port=free_port(), world_size=2)
            trainer = await asyncio.to_thread(
                WeightTransferTrainerFactory.trainer_init, info,
                InProcessWeightSyncClient(llm), ModuleSource(trainer_model(v2)),
            )  # fmt: skip
            outputs = await _swap_mid_flight(llm, trainer, prompts, max_tokens)
            return outputs, [llm.tokenizer.encode(p) for p in prompts], graphs
        finally:
            llm.shutdown()

    outputs, prompt_ids, graphs = asyncio.run(run())
    assert graphs.graph_steps > 0 and graphs.recaptures == 0
    fresh = LLM(str(v2), **kwargs)
    swapped = 0
    for output, ids in zip(outputs, prompt_ids, strict=True):
        boundary = next((s.start for s in output.weight_versions if s.version == 1), max_tokens)
        if boundary == max_tokens:
            continue  # finished before the pause
        swapped += 1
        pre, post = output.token_ids[:boundary], output.token_ids[boundary:]
        cont = SamplingParams(temperature=0.0, max_tokens=len(post), ignore_eos=True)
        again = fresh.generate([{"prompt_token_ids": ids + pre}], cont, use_tqdm=False)[0]
        assert again.outputs[0].token_ids == post
    assert swapped >= 3
