"""The decode graphs' logic on the CPU: an engine on the Triton kernels (under Triton's
interpreter) whose decode steps replay graphs recorded by the stand-in of
tests/helpers/graph_recorder.py, which bakes in what a CUDA graph bakes in (sizes, host
values, the addresses of every input) and refuses a stale input. Each test compares with
the same engine run eagerly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hotswap import LLM, SamplingParams
from hotswap.model.cuda.graphs import DecodeGraphs, capture_sizes
from hotswap.model.decode_paths import watched_tensors
from tests.helpers.graph_recorder import RecordingCapture, StaleGraphError
from tests.model.cuda.conftest import DEVICE

pytestmark = pytest.mark.skipif(DEVICE != "cpu", reason="the CPU stand-in of CUDA graphs")
slow = pytest.mark.slow  # engines on Triton's interpreter: seconds per step

PROMPTS = ["The quick brown", "Pause, swap the weights, resume", "x", "0123456789 and sym",
           "Paged attention stores keys and values in blocks. " * 3]  # fmt: skip
# staggered lengths: the batch shrinks 5 -> 1 over the run, through buckets 8, 4, 2, 1
LENGTHS = [3, 6, 9, 11, 14]


def engine(path: Path, **kwargs) -> LLM:  # noqa: ANN003
    return LLM(str(path), dtype="float32", attention_backend="TRITON_ATTN", progress=False,
               max_num_seqs=8, **kwargs)  # fmt: skip


def with_recorded_graphs(llm: LLM) -> DecodeGraphs:
    runner = llm.engine.runner
    runner.graphs = DecodeGraphs(
        runner.model, RecordingCapture(), watched_tensors(runner.model, lambda: runner.kv_caches),
        max_rows=8, max_blocks=-(-512 // runner.block_size), kv_heads=runner.model.local_heads[1],
        block_size=runner.block_size, device=runner.device,
    )  # fmt: skip
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
    assert_same(generate(llm), eager_outputs)
    assert graphs.graph_steps >= max(LENGTHS) - 2  # every decode step but none of prefill
    assert sorted(graphs.graphs) == [1, 2, 4, 8]  # one capture per bucket used
    assert graphs.captures == 4 and graphs.recaptures == 0
    assert graphs.eager_steps["prefill"] >= 1
    assert all(g.replays for g in graphs.capturer.graphs)
    llm.shutdown()


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
