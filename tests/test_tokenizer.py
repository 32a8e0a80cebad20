"""Tests for hotswap.tokenizer: loading, encode/decode and chat templates against transformers,
and IncrementalDetokenizer (multi-byte UTF-8 across tokens, stop strings, streaming deltas).

Tiny real tokenizers are trained here with the `tokenizers` library (no downloads): a GPT-2 style
byte-level BPE and a Llama-2 style Metaspace BPE with byte fallback.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jinja2
import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from hotswap.detokenizer import IncrementalDetokenizer
from hotswap.tokenizer import Tokenizer

CORPUS = (
    "Hello world! The quick brown fox jumps over the lazy dog. Stop here, then STOP! " * 8
    + "def add(a, b):\n    return a + b\n\n" * 4
    + "你好，世界！今天天气很好。我们去公园散步吧。机器学习很有趣。" * 6
    + "😀🎉🚀 emoji test 👍🏽 family 👨‍👩‍👧 " * 6
    + "Ünïcödé façade naïve café résumé — “quotes” … " * 6
)
SAMPLES = [
    "Hello world!",
    "  leading spaces and\ttabs\nnewlines  ",
    "你好，世界！机器学习",
    "emoji 😀🎉 and skin tone 👍🏽 and ZWJ 👨‍👩‍👧",
    "café naïve — “quotes”",
    "<|im_start|>user\nhi<|im_end|>",
    "unseen chars: Ω≈ç√∫ 𝔘𝔫𝔦",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Exercises raise_exception, tojson (with non-ASCII, HTML characters and options), trim_blocks /
# lstrip_blocks, loop controls and the generation tag.
TOOLS_TEMPLATE = """
{%- if messages[0]['role'] != 'system' %}
    {{- raise_exception('Conversation must start with a system message') }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] == 'system' %}
<|im_start|>system
{{ message['content'] }}
        {%- if tools %}

Tools: {{ tools | tojson }}
Pretty: {{ tools[0] | tojson(indent=2, sort_keys=true) }}
        {%- endif %}
<|im_end|>
    {%- elif message['role'] == 'assistant' %}
<|im_start|>assistant
{% generation %}{{ message['content'] }}{% endgeneration %}<|im_end|>
    {%- else %}
        {%- if message['content'] == 'skip me' %}{% continue %}{% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city, e.g. 北京 <b>&</b> 'quotes'",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


# ----------------------------------------------------------------------------------------------
# Fixtures: tiny tokenizers written as HF directories
# ----------------------------------------------------------------------------------------------


def _train_byte_level() -> RustTokenizer:
    tok = RustTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=420,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS], trainer)
    return tok


def _train_metaspace_byte_fallback() -> RustTokenizer:
    """Llama-2 style: Prepend/Replace normalizer, BPE with <0xXX> byte-fallback tokens, and a
    decoder that strips the sequence's leading space."""
    tok = RustTokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never")
    # A small alphabet leaves Chinese and emoji out of the vocabulary: they become byte tokens.
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<s>", "</s>"],
        limit_alphabet=60,
        show_progress=False,
    )
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.train_from_iterator([CORPUS], trainer)
    data = json.loads(tok.to_str())
    vocab = data["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    data["model"]["byte_fallback"] = True
    tok = RustTokenizer.from_str(json.dumps(data))
    bos = ("<s>", tok.token_to_id("<s>"))
    tok.post_processor = processors.TemplateProcessing(
        single="<s>:0 $A:0", pair="<s>:0 $A:0 <s>:1 $B:1", special_tokens=[bos]
    )
    return tok


def _write_dir(
    path: Path, tok: RustTokenizer, tokenizer_config: dict[str, Any] | None, **extra: Any
) -> Path:
    """tokenizer.json, tokenizer_config.json (unless None) and `name=data` as name.json files."""
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    if tokenizer_config is not None:
        data = {"tokenizer_class": "PreTrainedTokenizerFast", **tokenizer_config}
        (path / "tokenizer_config.json").write_text(json.dumps(data), encoding="utf-8")
    for name, data in extra.items():
        (path / f"{name}.json").write_text(json.dumps(data), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def byte_level_rust() -> RustTokenizer:
    return _train_byte_level()


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory: pytest.TempPathFactory, byte_level_rust: RustTokenizer) -> Path:
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML}
    return _write_dir(tmp_path_factory.mktemp("chatml"), byte_level_rust, config)


@pytest.fixture(scope="module")
def tok(chatml_dir: Path) -> Tokenizer:
    return Tokenizer.from_pretrained(chatml_dir)


@pytest.fixture(scope="module")
def hf_tok(chatml_dir: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(chatml_dir))


@pytest.fixture(scope="module")
def metaspace_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": True,
        "add_eos_token": False,
    }
    path = tmp_path_factory.mktemp("metaspace")
    return _write_dir(path, _train_metaspace_byte_fallback(), config)


def _stream(detok: IncrementalDetokenizer, ids: Sequence[int], chunk: int = 1) -> list[str]:
    """Feed ids `chunk` at a time, collecting get_delta() after each update and at the end."""
    deltas = []
    for i in range(0, len(ids), chunk):
        detok.update(ids[i : i + chunk])
        deltas.append(detok.get_delta(finished=False))
    deltas.append(detok.get_delta(finished=True))
    return deltas


def _split_char_ids(tok: Tokenizer, text: str) -> list[int]:
    """Encode text and check that some character really is split across tokens (guaranteed for
    characters absent from CORPUS, such as 𝔘 or Ω: BPE training may merge frequent ones)."""
    ids = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids), "test text must split a character"
    return ids


# ----------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------


def test_missing_tokenizer_json_names_the_path(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="tokenizer.json") as err:
        Tokenizer.from_pretrained(tmp_path)
    assert str(tmp_path) in str(err.value)


def test_special_ids(tok: Tokenizer, byte_level_rust: RustTokenizer) -> None:
    assert tok.eos_token_id == byte_level_rust.token_to_id("<|im_end|>")
    assert tok.pad_token_id == byte_level_rust.token_to_id("<|endoftext|>")
    assert tok.bos_token_id is None
    assert tok.all_special_ids == {byte_level_rust.token_to_id(t) for t in SPECIALS}
    assert tok.stop_token_ids == {tok.eos_token_id}
    assert tok.vocab_size == byte_level_rust.get_vocab_size(with_added_tokens=True)
    assert tok.chat_template == CHATML


def test_stop_token_ids_from_generation_config_list(
    tmp_path: Path, byte_level_rust: RustTokenizer
) -> None:
    ids = {t: byte_level_rust.token_to_id(t) for t in SPECIALS}
    _write_dir(
        tmp_path,
        byte_level_rust,
        {"eos_token": "<|im_end|>"},
        generation_config={"eos_token_id": [ids["<|endoftext|>"], ids["<|im_end|>"]]},
        config={"eos_token_id": 7, "text_config": {"eos_token_id": [11]}},
    )
    tok = Tokenizer.from_pretrained(str(tmp_path))
    assert tok.eos_token_id == ids["<|im_end|>"]
    assert tok.stop_token_ids == {ids["<|endoftext|>"], ids["<|im_end|>"], 7, 11}


def test_eos_falls_back_to_generation_config(
    tmp_path: Path, byte_level_rust: RustTokenizer
) -> None:
    _write_dir(tmp_path, byte_level_rust, None, generation_config={"eos_token_id": [2, 0]})
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.eos_token_id == 2
    assert tok.stop_token_ids == {0, 2}
    assert tok.chat_template is None


def test_added_token_dicts_and_bos_eos_flags_match_transformers(metaspace_dir: Path) -> None:
    """transformers 5 lets tokenizer.json's post-processor (here: prepend <s>) decide what is
    added, ignoring add_bos_token/add_eos_token; so must we."""
    transformers = pytest.importorskip("transformers")
    config = json.loads((metaspace_dir / "tokenizer_config.json").read_text())
    config["bos_token"] = {
        "__type": "AddedToken",
        "content": "<s>",
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
        "special": True,
    }
    config["add_eos_token"] = True
    (metaspace_dir / "cfg").mkdir(exist_ok=True)
    (metaspace_dir / "cfg" / "tokenizer_config.json").write_text(json.dumps(config))
    (metaspace_dir / "cfg" / "tokenizer.json").write_text(
        (metaspace_dir / "tokenizer.json").read_text()
    )
    for path in (metaspace_dir, metaspace_dir / "cfg"):
        ours = Tokenizer.from_pretrained(path)
        ref = transformers.AutoTokenizer.from_pretrained(str(path))
        assert ours.bos_token_id == ref.bos_token_id is not None
        for text in SAMPLES:
            assert ours.encode(text) == ref.encode(text)
            assert ours.encode(text)[0] == ours.bos_token_id
            assert ours.encode(text, add_special_tokens=False)[0] != ours.bos_token_id


def test_unknown_special_token_is_added_like_transformers(
    tmp_path: Path, byte_level_rust: RustTokenizer
) -> None:
    transformers = pytest.importorskip("transformers")
    # A new token gets a new id; a plain vocabulary token becomes special with its own id.
    config = {"eos_token": "<|custom_end|>", "pad_token": "Ġquick"}
    _write_dir(tmp_path, byte_level_rust, config)
    ours = Tokenizer.from_pretrained(tmp_path)
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.vocab_size == len(ref) == byte_level_rust.get_vocab_size() + 1
    assert ours.pad_token_id == ref.pad_token_id == byte_level_rust.token_to_id("Ġquick")
    assert ours.eos_token_id == ref.eos_token_id == byte_level_rust.get_vocab_size()
    assert {ours.eos_token_id, ours.pad_token_id} <= ours.all_special_ids
    text = "the fox<|custom_end|>Ġquick"
    ids = ours.encode(text)
    assert ids == ref.encode(text) and ids[-2:] == [ours.eos_token_id, ours.pad_token_id]
    assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True) == "the fox"


def test_chat_template_jinja_file_overrides_config(
    tmp_path: Path, byte_level_rust: RustTokenizer
) -> None:
    _write_dir(tmp_path, byte_level_rust, {"chat_template": CHATML})
    (tmp_path / "chat_template.jinja").write_text("J:{{ messages | length }}")
    tok = Tokenizer.from_pretrained(tmp_path)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "J:1"


# ----------------------------------------------------------------------------------------------
# Encode / decode against transformers
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("text", SAMPLES)
def test_encode_decode_match_transformers(tok: Tokenizer, hf_tok: Any, text: str) -> None:
    for add_special in (True, False):
        ids = tok.encode(text, add_special_tokens=add_special)
        assert ids == hf_tok.encode(text, add_special_tokens=add_special)
    for skip in (True, False):
        assert tok.decode(ids, skip_special_tokens=skip) == hf_tok.decode(
            ids, skip_special_tokens=skip
        )
    assert tok.convert_ids_to_tokens(ids) == hf_tok.convert_ids_to_tokens(ids)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_metaspace_encode_decode_match_transformers(metaspace_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ours = Tokenizer.from_pretrained(metaspace_dir)
    ref = transformers.AutoTokenizer.from_pretrained(str(metaspace_dir))
    assert ours.vocab_size == len(ref)
    for text in SAMPLES:
        ids = ours.encode(text)
        assert ids == ref.encode(text)
        for skip in (True, False):
            assert ours.decode(ids, skip) == ref.decode(ids, skip_special_tokens=skip)


# ----------------------------------------------------------------------------------------------
# Chat templates
# ----------------------------------------------------------------------------------------------

MESSAGES = [
    {"role": "system", "content": "You are helpful. 你好"},
    {"role": "user", "content": "Weather in 北京? 😀"},
    {"role": "assistant", "content": "Let me check.", "tool_calls": None},
    {"role": "user", "content": "skip me"},
    {"role": "user", "content": "Thanks!"},
]


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chatml_matches_transformers(
    tok: Tokenizer, hf_tok: Any, add_generation_prompt: bool
) -> None:
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
    ref = hf_tok.apply_chat_template(
        MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    assert text == ref
    assert text.endswith("<|im_start|>assistant\n") == add_generation_prompt
    ids = tok.apply_chat_template(
        MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    ref_ids = hf_tok.apply_chat_template(
        MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    assert ids == ref_ids
    assert ids.count(tok.eos_token_id) == len(MESSAGES)


def test_tools_template_with_tojson_matches_transformers(tok: Tokenizer, hf_tok: Any) -> None:
    for tools in (TOOLS, None):
        ours = tok.apply_chat_template(MESSAGES, tools=tools, chat_template=TOOLS_TEMPLATE)
        ref = hf_tok.apply_chat_template(
            MESSAGES,
            tools=tools,
            chat_template=TOOLS_TEMPLATE,
            tokenize=False,
            add_generation_prompt=True,
        )
        assert ours == ref
    ours = tok.apply_chat_template(MESSAGES, tools=TOOLS, chat_template=TOOLS_TEMPLATE)
    assert "北京 <b>&</b>" in ours  # no ASCII/HTML escaping, unlike jinja's own tojson
    assert '\n  "function": {' in ours  # tojson(indent=2, sort_keys=true)
    assert "skip me" not in ours  # {% continue %}


def test_raise_exception_matches_transformers(tok: Tokenizer, hf_tok: Any) -> None:
    no_system = MESSAGES[1:]
    with pytest.raises(jinja2.TemplateError, match="must start with a system message"):
        tok.apply_chat_template(no_system, chat_template=TOOLS_TEMPLATE)
    with pytest.raises(jinja2.TemplateError, match="must start with a system message"):
        hf_tok.apply_chat_template(no_system, chat_template=TOOLS_TEMPLATE, tokenize=False)


def test_continue_final_message_matches_transformers(tok: Tokenizer, hf_tok: Any) -> None:
    messages = [*MESSAGES[:2], {"role": "assistant", "content": "The weather is "}]
    ours = tok.apply_chat_template(messages, continue_final_message=True)
    ref = hf_tok.apply_chat_template(messages, continue_final_message=True, tokenize=False)
    assert ours == ref
    assert ours.endswith("<|im_start|>assistant\nThe weather is ")


def test_none_valued_message_fields_dropped_like_transformers(tok: Tokenizer, hf_tok: Any) -> None:
    messages = [{"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]
    template = "{% for m in messages %}{{ m | tojson }}|{{ m.content is defined }}{% endfor %}"
    ours = tok.apply_chat_template(messages, chat_template=template)
    assert ours == hf_tok.apply_chat_template(messages, chat_template=template, tokenize=False)
    assert ours == '{"role": "assistant", "tool_calls": [{"id": "1"}]}|False'
    assert messages[0]["content"] is None  # the caller's messages are not modified


def test_named_templates_list_form_and_globals(
    tmp_path: Path, byte_level_rust: RustTokenizer
) -> None:
    templates = [
        {"name": "default", "template": "D:{{ messages[0]['content'] }}|{{ eos_token }}"},
        {"name": "tool_use", "template": "T:{{ tools[0]['function']['name'] }}"},
        {"name": "date", "template": "{{ strftime_now('%Y') }}"},
    ]
    _write_dir(tmp_path, byte_level_rust, {"eos_token": "<|im_end|>", "chat_template": templates})
    tok = Tokenizer.from_pretrained(tmp_path)
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.chat_template == templates[0]["template"]
    assert tok.apply_chat_template(msgs) == "D:hi|<|im_end|>"
    assert tok.apply_chat_template(msgs, tools=TOOLS) == "T:get_weather"
    assert tok.apply_chat_template(msgs, chat_template="date").isdigit()
    assert tok.apply_chat_template(msgs, tokenize=True) == tok.encode(
        "D:hi|<|im_end|>", add_special_tokens=False
    )


def test_no_chat_template_raises_value_error(
    tmp_path: Path, byte_level_rust: RustTokenizer
) -> None:
    _write_dir(tmp_path, byte_level_rust, {"eos_token": "<|im_end|>"})
    tok = Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_is_sandboxed(tok: Tokenizer) -> None:
    for evil in ("{{ messages.__class__.__mro__ }}", "{{ ''.__class__.__mro__[1] }}"):
        with pytest.raises(jinja2.exceptions.SecurityError):
            tok.apply_chat_template([], chat_template=evil)
    with pytest.raises(jinja2.exceptions.SecurityError):  # immutable: no mutating methods
        tok.apply_chat_template([], chat_template="{% set x = [] %}{{ x.append(1) }}")


# ----------------------------------------------------------------------------------------------
# IncrementalDetokenizer: decoding
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_multibyte_split_across_tokens_never_emits_replacement(tok: Tokenizer, chunk: int) -> None:
    text = "你好😀🎉 👍🏽 family 👨‍👩‍👧 naïve 𝔘𝔫𝔦 Ω≈√"
    ids = _split_char_ids(tok, text)
    deltas = _stream(IncrementalDetokenizer(tok, tok.encode("Say: ")), ids, chunk)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


def test_byte_fallback_metaspace_matches_vllm_style_reference(metaspace_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tok = Tokenizer.from_pretrained(metaspace_dir)
    ref = transformers.AutoTokenizer.from_pretrained(str(metaspace_dir))
    prompt = tok.encode("Say hello:")
    for text in ["Hello 你好 world 😀𝔘!", "  two spaces", "机器学习 Ω very fun", "x"]:
        ids = _split_char_ids(tok, text) if not text.isascii() else tok.encode(text, False)
        deltas = _stream(IncrementalDetokenizer(tok, prompt), ids)
        assert all("\ufffd" not in d for d in deltas)
        assert "".join(deltas) == _vllm_reference(ref, prompt, ids)
        # The leading space survives because the prompt provides context (plain decode strips it).
        assert "".join(deltas) == " " + tok.decode(ids)
        # Without a prompt, streaming agrees with decode().
        assert "".join(_stream(IncrementalDetokenizer(tok, []), ids)) == tok.decode(ids)


def _vllm_reference(hf_tok: Any, prompt: list[int], ids: list[int]) -> str:
    """vLLM's detokenize_incrementally (prefix/read offsets over HF tokens), token by token."""
    tokens = hf_tok.convert_ids_to_tokens(prompt[-7:])
    read = len(tokens)
    prefix = max(read - 5, 0)
    out = ""
    for token_id in ids:
        tokens = tokens + hf_tok.convert_ids_to_tokens([token_id])
        prefix_text = hf_tok.convert_tokens_to_string(tokens[prefix:read])
        new_text = hf_tok.convert_tokens_to_string(tokens[prefix:])
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            out += new_text[len(prefix_text) :]
            prefix, read = read, len(tokens)
    return out


@pytest.mark.parametrize("skip", [True, False])
def test_random_sequences_concatenate_to_decode(tok: Tokenizer, skip: bool) -> None:
    """Any ids (invalid UTF-8, special tokens mid-character, odd chunking) with any prompt."""
    rng = random.Random(1234 + skip)
    special = sorted(tok.all_special_ids)
    for _ in range(300):
        prompt = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 9))]
        ids = [
            rng.choice(special) if rng.random() < 0.1 else rng.randrange(tok.vocab_size)
            for _ in range(rng.randrange(0, 40))
        ]
        detok = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip)
        deltas = _stream(detok, ids, chunk=rng.randrange(1, 4))
        expected = tok.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) == expected == detok.output_text, (prompt, ids)


def test_skip_special_tokens_on_and_off(tok: Tokenizer) -> None:
    ids = [*tok.encode("Hi 你好"), tok.eos_token_id, *tok.encode(" bye")]
    assert "".join(_stream(IncrementalDetokenizer(tok, [], skip_special_tokens=True), ids)) == (
        "Hi 你好 bye"
    )
    detok = IncrementalDetokenizer(tok, [], skip_special_tokens=False)
    assert "".join(_stream(detok, ids)) == "Hi 你好<|im_end|> bye"


def test_special_token_inside_character_and_trailing_partial_byte(tok: Tokenizer) -> None:
    ids = _split_char_ids(tok, "𝔘")
    mixed = [ids[0], tok.eos_token_id, *ids[1:]]
    for skip in (True, False):
        detok = IncrementalDetokenizer(tok, [], skip_special_tokens=skip)
        assert "".join(_stream(detok, mixed)) == tok.decode(mixed, skip_special_tokens=skip)
    # A generation cut off mid-character: held back while streaming, flushed as U+FFFD at the end.
    detok = IncrementalDetokenizer(tok, [])
    detok.update(ids[:1])
    assert detok.get_delta(finished=False) == "" and detok.output_text == ""
    assert detok.get_delta(finished=True) == tok.decode(ids[:1]) == "\ufffd"


def test_window_stays_small_for_long_invalid_byte_runs(tok: Tokenizer) -> None:
    lone_continuation = tok.encode("𝔘", add_special_tokens=False)[-1]
    assert tok.decode([lone_continuation]) == "\ufffd"
    detok = IncrementalDetokenizer(tok, [])
    for _ in range(200):
        detok.update([lone_continuation])
        assert len(detok._ids) <= 8  # O(1) work per token, not O(length)
    assert detok.output_text.count("\ufffd") >= 190
    # Skipped special tokens don't even enter the window.
    for _ in range(200):
        detok.update([tok.eos_token_id])
        assert len(detok._ids) <= 8


# ----------------------------------------------------------------------------------------------
# IncrementalDetokenizer: stop strings and deltas
# ----------------------------------------------------------------------------------------------


def _feed_until_stop(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[str | None, int]:
    for i, token_id in enumerate(ids):
        stop = detok.update([token_id])
        if stop is not None:
            return stop, i
    return None, len(ids)


def test_stop_string_straddling_two_updates(tok: Tokenizer) -> None:
    text = "Hello world! The quick brown fox"
    ids = tok.encode(text)
    stop = "world! The"
    # The stop string must span several tokens for this test to mean anything.
    pieces = [tok.decode([i]) for i in ids]
    assert not any(stop in p for p in pieces)
    detok = IncrementalDetokenizer(tok, [], stop=[stop])
    matched, at = _feed_until_stop(detok, ids)
    assert matched == stop
    assert stop in tok.decode(ids[: at + 1]) and stop not in tok.decode(ids[:at])
    assert detok.output_text == "Hello "
    assert detok.update(tok.encode(" more")) is None and detok.output_text == "Hello "
    assert detok.get_delta(finished=True) == "Hello "


def test_include_stop_str_in_output(tok: Tokenizer) -> None:
    ids = tok.encode("Stop here, then STOP! and more text")
    detok = IncrementalDetokenizer(tok, [], stop=["STOP!"], include_stop_str_in_output=True)
    deltas = []
    for token_id in ids:
        matched = detok.update([token_id])
        deltas.append(detok.get_delta(finished=matched is not None))
        if matched:
            break
    assert matched == "STOP!"
    assert detok.output_text == "Stop here, then STOP!" == "".join(deltas)


def test_earliest_stop_wins_and_stops_in_prompt_are_ignored(tok: Tokenizer) -> None:
    prompt = tok.encode("The quick brown fox")
    ids = tok.encode(" jumps over the lazy dog. The quick")
    detok = IncrementalDetokenizer(tok, prompt, stop=["quick", "lazy", "over the"])
    assert detok.update(ids) == "over the"  # one update with several matches: earliest wins
    assert detok.output_text == " jumps "
    # Overlapping stops in one update: the one that completes first wins, as token by token.
    detok = IncrementalDetokenizer(tok, [], stop=["brown fox jumps", "quick brown"])
    assert detok.update(tok.encode("The quick brown fox jumps")) == "quick brown"
    assert detok.output_text == "The "


def test_check_stop_false_and_empty_stop_strings(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [], stop=["", "fox"])
    assert detok.update(tok.encode("The quick brown fox"), check_stop=False) is None
    assert detok.update(tok.encode(" jumps")) is None  # "fox" is before the new text region
    assert detok.update(tok.encode(" fox")) == "fox"
    assert detok.output_text == "The quick brown fox jumps "


@pytest.mark.parametrize("chunk", [1, 3])
def test_get_delta_holds_back_partial_stop_strings(tok: Tokenizer, chunk: int) -> None:
    stop = "STOP!"
    ids = tok.encode("Hello world! Stop here, then STOP! never shown")
    detok = IncrementalDetokenizer(tok, [], stop=[stop])
    streamed = ""
    for i in range(0, len(ids), chunk):
        matched = detok.update(ids[i : i + chunk])
        if matched:
            break
        streamed += detok.get_delta(finished=False)
        # Never more than the output minus (len(stop) - 1) characters while running.
        assert len(streamed) == max(len(detok.output_text) - (len(stop) - 1), 0)
        assert not streamed.endswith(("S", "ST", "STO", "STOP"))
    assert matched == stop
    streamed += detok.get_delta(finished=True)
    assert streamed == detok.output_text == "Hello world! Stop here, then "
    assert detok.get_delta(finished=True) == ""


def test_get_delta_without_stops_streams_everything(tok: Tokenizer) -> None:
    detok = IncrementalDetokenizer(tok, [])
    detok.update(tok.encode("Hello world"))
    assert detok.get_delta(finished=False) == "Hello world"
    detok.update(tok.encode("!"))
    assert detok.get_delta(finished=False) == "!"
    assert detok.get_delta(finished=True) == ""
    assert detok.output_text == "Hello world!"
