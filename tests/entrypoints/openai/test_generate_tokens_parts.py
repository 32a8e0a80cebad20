"""The parts of POST /inference/v1/generate that need no server: vLLM's logprob order,
provenance spans joined across stream pieces, `stream_interval` batching and the
grammar's wait for the end of thinking under a reasoning parser."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hotswap.entrypoints.openai.generate_params import (
    gate_after_thinking,
    generate_sampling_params,
)
from hotswap.entrypoints.openai.generate_protocol import GenerateRequest
from hotswap.entrypoints.openai.generate_tokens import (
    ChoiceStream,
    clamp,
    ordered_candidates,
    take_delta,
    weight_spans_of,
)
from hotswap.entrypoints.server.state import ServerConfig
from hotswap.outputs import CompletionOutput, Logprob, WeightVersionSpan
from tests.entrypoints.openai.conftest import MODEL


def test_candidates_in_vllm_order() -> None:
    entries = {
        10: Logprob(-1.0, 1),
        11: Logprob(-2.0, 2),
        12: Logprob(-3.0, 3),
        42: Logprob(-5.0, 9),
    }
    # sampled outside the top 3: first, and it displaces the last of them (as vLLM cuts)
    assert [t for t, _ in ordered_candidates(42, entries, 3)] == [42, 10, 11]
    assert [t for t, _ in ordered_candidates(11, entries, 3)] == [11, 10, 12]
    assert [t for t, _ in ordered_candidates(11, entries, 0)] == [11]
    assert clamp(float("-inf")) == clamp(float("nan")) == -9999.0


def test_weight_spans_join_stream_pieces() -> None:
    pieces = [
        WeightVersionSpan(0, "a", 0, 2),
        WeightVersionSpan(0, "a", 2, 3),
        WeightVersionSpan(1, "a", 3, 5),
        WeightVersionSpan(2, "b", 5, 6, stale=True),
    ]
    spans = [s.model_dump() for s in weight_spans_of(pieces)]
    assert spans == [
        {"version": "a", "start": 0, "end": 3, "label": "a", "weight_gen": 0, "stale": False},
        {"version": "a", "start": 3, "end": 5, "label": "a", "weight_gen": 1, "stale": False},
        {"version": "b", "start": 5, "end": 6, "label": "b", "weight_gen": 2, "stale": True},
    ]


def test_take_delta_batches_by_interval() -> None:
    state = ChoiceStream()
    sent = []
    for i in range(7):
        delta = CompletionOutput(0, str(i), [i], finish_reason="length" if i == 6 else None)
        out = take_delta(state, delta, 3, text_mode=False)
        sent.append(None if out is None else out.token_ids)
    assert [s for s in sent if s is not None] == [[0], [1, 2, 3], [4, 5, 6]]
    assert take_delta(state, CompletionOutput(0, "", [9]), 3, text_mode=False) is None


class _Tokenizer:
    """Decodes [1] to a prompt whose thinking is still open, anything else to one that
    closed it; encodes every text (the end tag) to [99]."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "<|im_start|>assistant\n" if ids == [1] else "<think>\nhm</think>\n"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [99]


@pytest.mark.parametrize(
    ("parser", "extra", "gated"),
    [
        (None, {}, False),  # no reasoning parser: the grammar holds from the first token
        ("qwen3", {}, True),  # the prompt leaves the thinking open
        ("qwen3", {"token_ids": [5]}, False),  # the prompt closed it
        ("qwen3", {"reasoning_ended": True}, False),
        ("qwen3", {"token_ids": [5], "reasoning_ended": False}, True),
        ("qwen3", {"reasoning_parser_kwargs": {"chat_template_kwargs": {"enable_thinking": False}}},
         False),
    ],
)  # fmt: skip
def test_grammar_waits_for_the_end_of_thinking(parser, extra: dict, gated: bool) -> None:
    body = GenerateRequest.model_validate(
        {"token_ids": [1], "sampling_params": {"structured_outputs": {"regex": "a+"}}} | extra
    )
    params = generate_sampling_params(body.sampling_params, stream=False, defaults={})
    server = ServerConfig(served_model_name=MODEL, reasoning_parser=parser)
    gate_after_thinking(SimpleNamespace(tokenizer=_Tokenizer()), server, body, params)
    assert params.structured_outputs.start_after_token_ids == ([99] if gated else None)
