"""Tokenizer for the engine: HF `tokenizers` backend, HF-compatible chat templates, and an
incremental detokenizer for streaming generated text.

Only the Rust `tokenizers` library is used at runtime (no `transformers`), but loading, special
tokens, chat-template rendering and decoding follow what `transformers` does with the same files,
so prompts and outputs match what a model was trained and evaluated with.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as _Backend

_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


# ----------------------------------------------------------------------------------------------
# File loading helpers
# ----------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _as_added_token(value: Any) -> AddedToken | None:
    """tokenizer_config.json gives special tokens as strings or as serialized AddedToken dicts."""
    if isinstance(value, str):
        return AddedToken(value, special=True, normalized=False)
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return AddedToken(
            value["content"],
            single_word=bool(value.get("single_word", False)),
            lstrip=bool(value.get("lstrip", False)),
            rstrip=bool(value.get("rstrip", False)),
            normalized=bool(value.get("normalized", False)),
            special=True,
        )
    return None


def _load_chat_templates(path: Path, config: dict[str, Any]) -> dict[str, str]:
    """Named chat templates; a standalone chat_template.jinja/.json overrides tokenizer_config."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        return {"default": jinja_file.read_text(encoding="utf-8")}
    raw = _read_json(path / "chat_template.json").get("chat_template", config.get("chat_template"))
    if isinstance(raw, str):
        return {"default": raw}
    if isinstance(raw, list):  # HF's multi-template form: [{"name": ..., "template": ...}, ...]
        return {t["name"]: t["template"] for t in raw if isinstance(t, dict) and "name" in t}
    return {}


def _config_eos_ids(path: Path) -> list[int]:
    """eos_token_id (int or list) in generation_config.json and config.json (and text_config)."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        data = _read_json(path / name)
        for section in (data, data.get("text_config")):
            value = section.get("eos_token_id") if isinstance(section, dict) else None
            values = value if isinstance(value, list) else [value]
            ids.extend(v for v in values if isinstance(v, int) and not isinstance(v, bool))
    return ids


# ----------------------------------------------------------------------------------------------
# Chat templates (same environment as transformers.utils.chat_template_utils)
# ----------------------------------------------------------------------------------------------


class _GenerationTag(Extension):
    """Accepts HF's `{% generation %}...{% endgeneration %}` (assistant-mask markers) and just
    renders the body; without it such templates would not even parse."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # HF replaces jinja's tojson: no HTML escaping, non-ASCII kept, and json.dumps' options.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _jinja_env() -> ImmutableSandboxedEnvironment:
    # Templates come from model repos, i.e. untrusted: render them sandboxed.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=32)
def _compile_template(template: str) -> jinja2.Template:
    return _jinja_env().from_string(template)


def _normalize_messages(messages: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    # Like transformers 5: drop None-valued keys (OpenAI-style `content=None`, `tool_calls=None`),
    # which many templates would otherwise render as the text "None". Copies, so callers' dicts
    # are never modified.
    return [{k: v for k, v in m.items() if v is not None} for m in messages]


def _tag_final_message(messages: list[dict[str, Any]]) -> None:
    """Append HF's continue tag to the last message's text, to find where it ends once rendered."""
    if not messages:
        raise ValueError("continue_final_message is set but there are no messages")
    final = messages[-1]
    content = final.get("content")
    if isinstance(content, str):
        final["content"] = content + _CONTINUE_TAG
        return
    blocks = list(content) if isinstance(content, (list, tuple)) else []
    for i in reversed(range(len(blocks))):
        if isinstance(blocks[i], dict) and isinstance(blocks[i].get("text"), str):
            blocks[i] = {**blocks[i], "text": blocks[i]["text"] + _CONTINUE_TAG}
            final["content"] = blocks
            return
    raise ValueError("continue_final_message is set but the final message has no text to continue")


def _cut_at_continue_tag(rendered: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if tag not in rendered:
        raise ValueError(
            "continue_final_message is set but the final message does not appear in the rendered "
            "chat (the chat template drops or rewrites it)"
        )
    loc = rendered.rindex(tag)
    # Templates that strip message content also strip our tag's trailing space: strip likewise.
    return rendered[:loc] if rendered.startswith(_CONTINUE_TAG, loc) else rendered[:loc].rstrip()


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------


class Tokenizer:
    """A HF tokenizer directory (tokenizer.json + optional configs) behind a small API."""

    def __init__(
        self,
        backend: _Backend,
        config: dict[str, Any] | None = None,
        *,
        chat_templates: dict[str, str] | None = None,
        extra_eos_ids: Iterable[int] = (),
        name_or_path: str = "<in-memory>",
    ) -> None:
        # add_bos_token/add_eos_token in the config are deliberately not applied: like transformers
        # 5 when a tokenizer.json exists, its post-processor alone decides what encode() adds.
        config = config or {}
        self._backend = backend
        self.name_or_path = name_or_path
        # tokenizer.json may carry batch padding/truncation settings; encode() must not apply them.
        backend.no_padding()
        backend.no_truncation()
        self.special_tokens: dict[str, str] = self._register_special_tokens(config)
        self.bos_token_id = self._token_id(self.special_tokens.get("bos_token"))
        self.pad_token_id = self._token_id(self.special_tokens.get("pad_token"))
        self.unk_token_id = self._token_id(self.special_tokens.get("unk_token"))
        extra_eos = list(extra_eos_ids)
        eos_id = self._token_id(self.special_tokens.get("eos_token"))
        # No eos_token in tokenizer_config.json: fall back to the model config's (first) eos id.
        self.eos_token_id = eos_id if eos_id is not None else next(iter(extra_eos), None)
        self.stop_token_ids = frozenset(extra_eos) | _ids_set(self.eos_token_id)
        # Exactly the ids that the backend drops under skip_special_tokens=True.
        self._skipped_ids = frozenset(
            i for i, tok in backend.get_added_tokens_decoder().items() if tok.special
        )
        named = (self.bos_token_id, self.eos_token_id, self.pad_token_id, self.unk_token_id)
        self.all_special_ids = self._skipped_ids | frozenset(i for i in named if i is not None)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self._chat_templates = dict(chat_templates or {})
        self.chat_template: str | None = self._chat_templates.get("default")

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"tokenizer.json not found in {str(path)!r}: a HF tokenizer directory with a "
                "tokenizer.json (fast tokenizer) file is required"
            )
        config = _read_json(path / "tokenizer_config.json")
        return cls(
            _Backend.from_file(str(tokenizer_file)),
            config,
            chat_templates=_load_chat_templates(path, config),
            extra_eos_ids=_config_eos_ids(path),
            name_or_path=str(path),
        )

    # -- construction helpers ------------------------------------------------------------------

    def _register_special_tokens(self, config: dict[str, Any]) -> dict[str, str]:
        """Named special tokens; like transformers, ones that the backend doesn't already know as
        added tokens are added as special (so they encode atomically and are skipped in decode)."""
        known = {tok.content for tok in self._backend.get_added_tokens_decoder().values()}
        tokens: dict[str, str] = {}
        for name in _SPECIAL_TOKEN_NAMES:
            added = _as_added_token(config.get(name))
            if added is None:
                continue
            tokens[name] = added.content
            if added.content not in known:
                self._backend.add_special_tokens([added])
                known.add(added.content)
        return tokens

    def _token_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    # -- encode / decode -----------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        # Note: no clean_up_tokenization_spaces (transformers skips it for BPE too), so that
        # decode() equals the concatenation of IncrementalDetokenizer's output.
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str | None]:
        """Token strings; None for ids outside the vocabulary (as transformers does)."""
        return [self._backend.id_to_token(int(i)) for i in ids]

    def __len__(self) -> int:
        return self.vocab_size

    # -- chat template -------------------------------------------------------------------------

    def _select_template(self, chat_template: str | None, tools: Any) -> str:
        """transformers' get_chat_template: a template name or source, else tool_use/default."""
        if chat_template is not None:
            return self._chat_templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in self._chat_templates:
            return self._chat_templates["tool_use"]
        if self.chat_template is not None:
            return self.chat_template
        if self._chat_templates:
            raise ValueError(
                f"Tokenizer {self.name_or_path!r} has several chat templates and no 'default' one; "
                f"pass chat_template= one of {sorted(self._chat_templates)}"
            )
        raise ValueError(
            f"Tokenizer {self.name_or_path!r} has no chat template (no chat_template in "
            "tokenizer_config.json, chat_template.jinja or chat_template.json); pass "
            "chat_template= explicitly or use a plain text prompt"
        )

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: list[dict[str, Any]] | None = None,
        documents: list[dict[str, Any]] | None = None,
        chat_template: str | None = None,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` like transformers' apply_chat_template (but add_generation_prompt
        defaults to True, and tokenize to False). `continue_final_message` leaves the last message
        open for the model to continue (and then adds no generation prompt)."""
        compiled = _compile_template(self._select_template(chat_template, tools))
        chat = _normalize_messages(messages)
        if continue_final_message:
            _tag_final_message(chat)
        rendered = compiled.render(
            messages=chat,
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            **{**self.special_tokens, **template_kwargs},
        )
        if continue_final_message:
            rendered = _cut_at_continue_tag(rendered)
        # The template already wrote BOS etc., so the post-processor must not add them again.
        return self.encode(rendered, add_special_tokens=False) if tokenize else rendered


def _ids_set(token_id: int | None) -> frozenset[int]:
    return frozenset() if token_id is None else frozenset((token_id,))


# ----------------------------------------------------------------------------------------------
# Incremental detokenization
# ----------------------------------------------------------------------------------------------
