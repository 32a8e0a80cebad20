"""Request bodies and the status vLLM 0.32 answers each with: the compatibility table.

Each case is (id, route, extra fields merged into the route's base body). vLLM's answers
live in data/vllm_answers.json, recorded against a real `vllm serve` (vLLM's CPU build,
the built-in SmolLM2 model served as "tiny", max-model-len 512, no tool flags) by
`python tests/entrypoints/openai/record_vllm_answers.py`; test_compat.py sends every body
to hotswap and expects the same class of answer (2xx or 4xx). `DIFFERENCES` names the
cases where hotswap deliberately answers otherwise, and why. Token ids stay below 384 so
they exist in the tiny test model's vocabulary too."""

from __future__ import annotations

from typing import Any

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
BASE: dict[str, dict[str, Any]] = {
    CHAT: {"model": "tiny", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
    COMPLETIONS: {"model": "tiny", "max_tokens": 4, "prompt": "hi"},
}
TOOL = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {
            "type": "object",
            "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["x"],
        },
    },
}
SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}

CASES: list[tuple[str, str, dict[str, Any]]] = [
    # lax coercions vLLM's pydantic models perform
    ("chat-logprobs-1", CHAT, {"logprobs": 1}),
    ("chat-logprobs-1-top-2", CHAT, {"logprobs": 1, "top_logprobs": 2}),
    ("chat-logprobs-str", CHAT, {"logprobs": "true"}),
    ("chat-n-str", CHAT, {"n": "2"}),
    ("chat-temperature-str", CHAT, {"temperature": "0.5"}),
    ("chat-max-tokens-float", CHAT, {"max_tokens": 4.0}),
    ("chat-seed-str", CHAT, {"seed": "7"}),
    ("chat-ignore-eos-int", CHAT, {"ignore_eos": 1}),
    ("chat-top-k-minus-1", CHAT, {"top_k": -1}),
    ("chat-stop-str", CHAT, {"stop": "x"}),
    (
        "chat-content-parts",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
    ),
    ("chat-max-completion-tokens", CHAT, {"max_completion_tokens": 3}),
    ("chat-unknown-field", CHAT, {"no_such_field": {"a": 1}}),
    ("chat-user", CHAT, {"user": "u1"}),
    ("chat-echo", CHAT, {"echo": True}),
    ("chat-min-tokens", CHAT, {"min_tokens": 2}),
    ("chat-prompt-logprobs", CHAT, {"prompt_logprobs": 1}),
    ("chat-return-token-ids", CHAT, {"return_token_ids": True}),
    ("chat-template-kwargs", CHAT, {"chat_template_kwargs": {"enable_thinking": False}}),
    ("chat-include-reasoning", CHAT, {"include_reasoning": False}),
    # logits controls
    ("chat-logit-bias", CHAT, {"logit_bias": {"5": 1}}),
    ("chat-logit-bias-str-value", CHAT, {"logit_bias": {"5": "1.5"}}),
    ("chat-logit-bias-clamped", CHAT, {"logit_bias": {"5": 500}}),
    ("chat-allowed-token-ids", CHAT, {"allowed_token_ids": [5, 6, 7]}),
    ("chat-bad-words", CHAT, {"bad_words": ["hello", "world"]}),
    # structured outputs
    ("chat-json-object", CHAT, {"response_format": {"type": "json_object"}}),
    (
        "chat-json-schema",
        CHAT,
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "s", "schema": SCHEMA},
            }
        },
    ),
    ("chat-response-format-text", CHAT, {"response_format": {"type": "text"}}),
    ("chat-so-regex", CHAT, {"structured_outputs": {"regex": "[a-z]+"}}),
    ("chat-so-choice", CHAT, {"structured_outputs": {"choice": ["yes", "no"]}}),
    ("chat-so-json", CHAT, {"structured_outputs": {"json": SCHEMA}}),
    ("chat-so-grammar", CHAT, {"structured_outputs": {"grammar": 'start: "a" "b"*'}}),
    (
        "chat-so-whitespace",
        CHAT,
        {"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
    ),
    ("chat-guided-json", CHAT, {"guided_json": SCHEMA}),
    # tools
    ("chat-tools-none", CHAT, {"tools": [TOOL], "tool_choice": "none"}),
    ("chat-tools-required", CHAT, {"tools": [TOOL], "tool_choice": "required", "max_tokens": 40}),
    (
        "chat-tools-named",
        CHAT,
        {
            "tools": [TOOL],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
            "max_tokens": 40,
        },
    ),
    (
        "chat-tools-parallel-false",
        CHAT,
        {
            "tools": [TOOL],
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_tokens": 40,
        },
    ),
    # refused by vLLM too
    ("chat-logprobs-bad", CHAT, {"logprobs": "sometimes"}),
    ("chat-n-word", CHAT, {"n": "two"}),
    ("chat-max-tokens-fraction", CHAT, {"max_tokens": 4.5}),
    ("chat-stop-int", CHAT, {"stop": 5}),
    ("chat-temperature-negative", CHAT, {"temperature": -1}),
    ("chat-top-p-zero", CHAT, {"top_p": 0}),
    ("chat-n-zero", CHAT, {"n": 0}),
    ("chat-top-logprobs-21", CHAT, {"logprobs": True, "top_logprobs": 21}),
    ("chat-top-logprobs-without-logprobs", CHAT, {"top_logprobs": 2}),
    ("chat-logit-bias-word", CHAT, {"logit_bias": {"abc": 1}}),
    ("chat-allowed-out-of-vocab", CHAT, {"allowed_token_ids": [10**7]}),
    ("chat-json-schema-missing", CHAT, {"response_format": {"type": "json_schema"}}),
    ("chat-so-two-kinds", CHAT, {"structured_outputs": {"regex": "a", "choice": ["a"]}}),
    ("chat-so-none", CHAT, {"structured_outputs": {}}),
    ("chat-tools-empty", CHAT, {"tools": []}),
    ("chat-tool-choice-without-tools", CHAT, {"tool_choice": "required"}),
    (
        "chat-tool-choice-unknown-name",
        CHAT,
        {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
    ),
    ("chat-tools-auto-without-flags", CHAT, {"tools": [TOOL]}),
    ("chat-priority", CHAT, {"priority": 1}),
    ("chat-stream-options-without-stream", CHAT, {"stream_options": {"include_usage": True}}),
    ("chat-no-messages", CHAT, {"messages": []}),
    (
        "chat-continue-and-generation-prompt",
        CHAT,
        {"continue_final_message": True, "add_generation_prompt": True},
    ),
    # completions
    ("cmpl-logprobs-1", COMPLETIONS, {"logprobs": 1}),
    ("cmpl-token-ids", COMPLETIONS, {"prompt": [1, 2, 3]}),
    ("cmpl-echo-str", COMPLETIONS, {"echo": "true"}),
    ("cmpl-so-regex", COMPLETIONS, {"structured_outputs": {"regex": "[a-z]+"}}),
    ("cmpl-json-object", COMPLETIONS, {"response_format": {"type": "json_object"}}),
    ("cmpl-guided-regex", COMPLETIONS, {"guided_regex": "[a-z]+"}),
    ("cmpl-logit-bias", COMPLETIONS, {"logit_bias": {"7": -100}}),
    ("cmpl-bad-words", COMPLETIONS, {"bad_words": ["the"]}),
    ("cmpl-max-tokens-null", COMPLETIONS, {"max_tokens": None}),
    ("cmpl-unknown-field", COMPLETIONS, {"no_such_field": 1}),
    ("cmpl-suffix", COMPLETIONS, {"suffix": "x"}),
    ("cmpl-logprobs-21", COMPLETIONS, {"logprobs": 21}),
    ("cmpl-prompt-int-str", COMPLETIONS, {"prompt": ["1", 2]}),
    ("cmpl-so-bad-regex", COMPLETIONS, {"structured_outputs": {"regex": "a(b"}}),
]

# Where hotswap answers otherwise, on purpose (case id -> why).
_FORCED = (
    "hotswap reads a forced call from the JSON its grammar produced, so it needs no "
    "--tool-call-parser; vLLM 0.32 refuses these without one"
)
DIFFERENCES: dict[str, str] = {
    "chat-tools-required": _FORCED,
    "chat-tools-named": _FORCED,
    "chat-tools-parallel-false": _FORCED,
}
