"""The compatibility table: every body of compat_cases.py gets the class of answer vLLM
0.32 gives it (recorded against a real `vllm serve` in data/vllm_answers.json): accepted
where vLLM accepts (its lax coercions included), refused with a 400 naming a field where
vLLM refuses, except the documented DIFFERENCES."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.entrypoints.openai.compat_cases import BASE, CASES, DIFFERENCES

ANSWERS = json.loads((Path(__file__).parent / "data" / "vllm_answers.json").read_text())


def test_every_case_has_a_recorded_answer() -> None:
    assert {case_id for case_id, _, _ in CASES} == set(ANSWERS)


@pytest.mark.parametrize(("case_id", "route", "extra"), CASES, ids=[c[0] for c in CASES])
def test_answer_class_matches_vllm(http, case_id: str, route: str, extra: dict) -> None:
    response = http.post(route, json={**BASE[route], **extra})
    vllm_ok = ANSWERS[case_id] < 400
    expected_ok = vllm_ok != (case_id in DIFFERENCES)
    assert (response.status_code < 400) == expected_ok, (ANSWERS[case_id], response.text)
    if response.status_code >= 400:
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] and error["param"].startswith("body"), error


@pytest.mark.parametrize(
    ("route", "extra"),
    [
        ("/v1/completions", {"structured_outputs": {"regex": "[a-c]{3}-[0-9]"}}),
        ("/v1/completions", {"guided_regex": "[a-c]{3}-[0-9]"}),  # vLLM ignores it; honoured
        ("/v1/chat/completions", {"structured_outputs": {"regex": "[a-c]{3}-[0-9]"}}),
    ],
)
def test_constraints_are_applied_not_dropped(http, route: str, extra: dict) -> None:
    body = {**BASE[route], "max_tokens": 20, "temperature": 1.0, "seed": 5, **extra}
    choice = http.post(route, json=body).json()["choices"][0]
    text = choice["text"] if "text" in choice else choice["message"]["content"]
    assert re.fullmatch("[a-c]{3}-[0-9]", text), text
    assert choice["finish_reason"] == "stop"
