"""Structured outputs: llguidance's masks in the sampler, checked against an independent
computation (transformers' float32 logits with the mask of a fresh llguidance matcher fed
the same tokens), and outputs that parse, validate and match."""

from __future__ import annotations

import copy
import json
import re

import llguidance
import pytest
import torch

from hotswap import LLM, SamplingParams
from hotswap.errors import InvalidArgument
from hotswap.sampling_params import StructuredOutputsParams
from hotswap.structured_output import (
    GrammarCompiler,
    StructuredOutputsConfig,
    check_grammar,
    declare_unlisted,
    grammar_text,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "colour": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "colour"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llm(tiny_llama):
    return LLM(str(tiny_llama), dtype="float32", block_size=8, progress=False)


def constrained(seed: int, **constraint) -> SamplingParams:  # noqa: ANN003
    return SamplingParams(
        temperature=1.0,
        seed=seed,
        max_tokens=80,
        logprobs=2,
        structured_outputs=StructuredOutputsParams(**constraint),
    )


def validate(value: object, schema: dict) -> None:
    """The schema's own rules, written out (no validator library in the dependencies)."""
    assert isinstance(value, dict) and set(value) == set(schema["required"])
    assert isinstance(value["name"], str) and len(value["name"]) <= 6
    assert isinstance(value["age"], int) and 0 <= value["age"] <= 99
    assert value["colour"] in ("red", "green", "blue")


def test_json_schema_outputs_parse_and_validate_beside_unconstrained_rows(llm) -> None:
    prompt = list(range(10, 30))
    params = [constrained(i, json=SCHEMA, disable_any_whitespace=True) for i in range(4)]
    params += [SamplingParams(temperature=1.0, seed=9, max_tokens=20, ignore_eos=True)]
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    for out in outs[:4]:
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        validate(json.loads(out.outputs[0].text), SCHEMA)
    assert len(outs[4].outputs[0].token_ids) == 20  # the free row was not masked to EOS


def test_regex_and_choice_outputs_match(llm) -> None:
    prompt = list(range(40, 50))
    params = [constrained(i, regex=r"[a-e]{2}-\d{3}") for i in range(3)]
    params += [constrained(i, choice=["alpha", "beta", "gamma delta"]) for i in range(3)]
    outs = llm.generate([prompt] * len(params), params, use_tqdm=False)
    for out in outs[:3]:
        assert re.fullmatch(r"[a-e]{2}-\d{3}", out.outputs[0].text), out.outputs[0].text
    for out in outs[3:]:
        assert out.outputs[0].text in ("alpha", "beta", "gamma delta")


def test_grammar_and_json_object(llm) -> None:
    lark = 'start: "x" ("+" "x")* "=" NUMBER\nNUMBER: /[0-9]{1,3}/'
    outs = llm.generate(
        [[5, 6, 7]] * 2,
        [constrained(1, grammar=lark), constrained(2, json_object=True)],
        use_tqdm=False,
    )
    assert re.fullmatch(r"x(\+x)*=[0-9]{1,3}", outs[0].outputs[0].text)
    if outs[1].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(outs[1].outputs[0].text), dict)
    else:  # cut by max_tokens inside the object: still its prefix
        assert outs[1].outputs[0].text.lstrip().startswith("{")


def test_masked_logprobs_equal_transformers_with_the_same_mask(llm, tiny_llama) -> None:
    """Raw logprobs (vLLM's raw mode includes the grammar mask) of every sampled token,
    against transformers' logits masked by a fresh matcher that is fed the same tokens."""
    from transformers import AutoModelForCausalLM

    prompt = list(range(60, 75))
    params = constrained(3, json=SCHEMA)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    tokens = out.outputs[0].token_ids
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0]
    vocab = logits.shape[-1]
    tokenizer_json = (tiny_llama / "tokenizer.json").read_text()
    ll_tokenizer = llguidance.LLTokenizer(
        tokenizer_json, n_vocab=vocab, eos_token=llm.tokenizer.eos_token_id
    )
    matcher = llguidance.LLMatcher(ll_tokenizer, grammar_text(params.structured_outputs))
    for step, token in enumerate(tokens):
        mask = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.uint8)
        allowed = torch.tensor([(mask[t // 8] >> (t % 8)) & 1 for t in range(vocab)]).bool()
        row = logits[len(prompt) + step - 1].masked_fill(~allowed, float("-inf"))
        expected = torch.log_softmax(row, dim=-1)
        got = out.outputs[0].logprobs[step][token].logprob
        assert got == pytest.approx(float(expected[token]), abs=1e-4), step
        assert matcher.consume_token(token)


def test_matchers_follow_their_own_requests_under_preemption_free_batching(llm) -> None:
    """n=3 with one constraint: three matchers, each advanced only by its own tokens."""
    params = constrained(4, choice=["one two", "three", "four five six"])
    params.n = 3
    (out,) = llm.generate([[9, 9, 9]], params, use_tqdm=False)
    assert {c.text for c in out.outputs} <= {"one two", "three", "four five six"}


@pytest.mark.parametrize(
    ("constraint", "field"),
    [
        ({"regex": "a(b"}, "structured_outputs.regex"),
        ({"json": "{not json"}, "structured_outputs.json"),
        ({"grammar": "start: undefined_rule"}, "structured_outputs.grammar"),
        (
            {"json": {"type": "object", "properties": {"a": {"type": "nonsense"}}}},
            "structured_outputs.json",
        ),
    ],
)
def test_bad_constraints_are_refused_naming_the_field(llm, constraint: dict, field: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        check_grammar(StructuredOutputsParams(**constraint))
    assert caught.value.field == field
    before = llm.engine.scheduler.kv.num_free_blocks
    with pytest.raises(ValueError, match=field.split(".")[1]):
        llm.generate(
            [[1, 2]],
            SamplingParams(structured_outputs=StructuredOutputsParams(**constraint)),
            use_tqdm=False,
        )
    assert llm.engine.scheduler.kv.num_free_blocks == before
    assert not llm.engine.scheduler.requests


def test_exactly_one_constraint() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])


def test_compiler_caches_compiled_constraints_and_gives_fresh_matchers(llm, tiny_llama) -> None:
    compiler = GrammarCompiler.from_tokenizer_dir(tiny_llama, 384, llm.tokenizer.eos_token_id)
    first = compiler.matcher(StructuredOutputsParams(choice=["ab", "cd"]))
    for token in llm.tokenizer.encode("ab", add_special_tokens=False):
        assert first.accept(token)
    assert first.matcher.is_accepting()
    second = compiler.matcher(StructuredOutputsParams(choice=["ab", "cd"]))
    assert len(compiler._cache) == 1
    assert not second.matcher.is_accepting()  # a fresh copy: nothing consumed
    assert not second.accept(llm.tokenizer.encode("x", add_special_tokens=False)[0])
    assert second.error is not None and not second.constrains  # refused: stops masking


def test_a_constraint_waits_for_its_start_marker(llm) -> None:
    """start_after_token_ids (the end of thinking): free until the output ends with them,
    constrained from there on."""
    prompt = list(range(80, 95))
    free = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    (reference,) = llm.generate([prompt], free, use_tqdm=False)
    marker = reference.outputs[0].token_ids[:2]
    constraint = StructuredOutputsParams(regex="[a-e]{3}", start_after_token_ids=marker)
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=constraint)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    ids = out.outputs[0].token_ids
    assert ids[:2] == marker
    assert re.fullmatch("[a-e]{3}", llm.tokenizer.decode(ids[2:])), llm.tokenizer.decode(ids)
    assert out.outputs[0].finish_reason == "stop"


ANSWER = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}


def test_declare_unlisted_says_what_every_level_leaves_unsaid() -> None:
    schema = {
        "type": "object",
        "properties": {
            "properties": {"type": "object", "properties": {"x": {"type": "integer"}}},
            "open": {"type": "object", "properties": {}, "additionalProperties": True},
            "typed": {"properties": {}, "additionalProperties": {"type": "string"}},
            "later": {"properties": {}, "unevaluatedProperties": True},
            "pair": {"type": "array", "prefixItems": [{"type": "integer"}]},
            "old_pair": {"type": "array", "items": [{"type": "integer"}]},
            "points": {"type": "array", "items": {"$ref": "#/$defs/point"}},
            "literal": {"const": {"properties": {}}, "default": {"properties": {}}},
            "either": {"anyOf": [{"properties": {"a": {}}}, {"type": "string"}]},
            "any": {"type": "object"},
        },
        "$defs": {"point": {"properties": {"x": {}}, "required": ["x"]}},
    }
    before = copy.deepcopy(schema)
    closed = declare_unlisted(schema, allowed=False)
    assert schema == before  # the caller's schema is not modified
    inner = closed["properties"]
    assert closed["additionalProperties"] is False and set(inner) == set(schema["properties"])
    assert inner["properties"]["additionalProperties"] is False  # a property, not a keyword
    assert inner["open"] == before["properties"]["open"]  # what a schema says stays
    assert inner["typed"] == before["properties"]["typed"]
    assert inner["later"] == before["properties"]["later"]
    assert inner["pair"]["items"] is False and inner["old_pair"]["additionalItems"] is False
    assert inner["points"] == before["properties"]["points"]  # its items are not a tuple
    assert inner["literal"] == before["properties"]["literal"]  # values, not schemas
    assert inner["either"]["anyOf"] == [{"properties": {"a": {}}, "additionalProperties": False},
                                        {"type": "string"}]  # fmt: skip
    assert inner["any"] == {"type": "object"}  # lists nothing: any object (as xgrammar)
    assert closed["$defs"]["point"]["additionalProperties"] is False
    opened = declare_unlisted(schema, allowed=True)
    assert opened["additionalProperties"] is True and opened["properties"]["pair"]["items"] is True
    assert declare_unlisted(True, allowed=False) is True


def accepts(compiler: GrammarCompiler, llm, params: StructuredOutputsParams, text: str) -> bool:  # noqa: ANN001
    """Whether the constraint's matcher takes `text`'s tokens and ends there complete."""
    matcher = compiler.matcher(params)
    tokens = llm.tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept(t) for t in tokens) and matcher.matcher.is_accepting()


def test_schemas_allow_only_what_they_list_unless_they_or_the_server_say_more(
    llm, tiny_llama
) -> None:
    compiler = GrammarCompiler.from_tokenizer_dir(tiny_llama, 384, llm.tokenizer.eos_token_id)
    exact, extra = '{"answer": 4}', '{"answer": 4, "note": "x"}'

    def takes(text: str, server: str | None = None, **constraint) -> bool:  # noqa: ANN003
        params = StructuredOutputsParams(**constraint)
        StructuredOutputsConfig.from_json(server).apply(params)
        return accepts(compiler, llm, params, text)

    for schema in (ANSWER, json.dumps(ANSWER)):  # vLLM's default (xgrammar's strict mode)
        assert takes(exact, json=schema) and not takes(extra, json=schema)
    assert takes(extra, json={**ANSWER, "additionalProperties": True})
    assert takes("[1]", json={"prefixItems": [{"type": "integer"}]})
    assert not takes("[1, 2]", json={"prefixItems": [{"type": "integer"}]})
    assert takes('{"a": [1, {"b": 2}]}', json_object=True)
    guidance = '{"backend": "guidance"}'  # vLLM's llguidance backend: JSON Schema's default
    assert takes(extra, guidance, json=ANSWER) and takes(extra, guidance, json=json.dumps(ANSWER))
    assert takes("[1, 2]", guidance, json={"prefixItems": [{"type": "integer"}]})
    assert not takes(extra, guidance, json=ANSWER, disable_additional_properties=True)
    closed = '{"backend": "guidance", "disable_additional_properties": true}'
    assert not takes(extra, closed, json=ANSWER)
    broken = StructuredOutputsParams(json="{oops")
    StructuredOutputsConfig.from_json(guidance).apply(broken)
    with pytest.raises(InvalidArgument, match="json"):
        grammar_text(broken)
