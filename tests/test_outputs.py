"""CompletionOutput.token_versions: the per-token list unrolled from the version spans."""

from __future__ import annotations

from hotswap.outputs import CompletionOutput, WeightVersionSpan


def test_token_versions_unrolls_spans() -> None:
    spans = [
        WeightVersionSpan(0, "default", 0, 3),
        WeightVersionSpan(1, "step-1", 3, 4, stale=True),
        WeightVersionSpan(2, "step-2", 4, 6),
    ]
    out = CompletionOutput(0, token_ids=[5, 6, 7, 8, 9, 10], weight_versions=spans)
    assert out.token_versions == [0, 0, 0, 1, 2, 2]
    # a delta output: spans keep absolute indexes, the list covers this delta's tokens
    delta = CompletionOutput(
        0, token_ids=[9, 10], weight_versions=[WeightVersionSpan(2, "s", 4, 6)]
    )
    assert delta.token_versions == [2, 2]
    assert CompletionOutput(0).token_versions == []
