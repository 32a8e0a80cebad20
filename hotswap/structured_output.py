"""Structured outputs: a request's constraint (JSON schema, regex, choice, grammar)
compiled by llguidance into a matcher that says, before every step, which tokens may come
next, as one bitmask row per constrained request.

JSON schemas are read as vLLM reads them by default: its "auto" backend compiles them with
xgrammar, whose strict mode generates only what a schema lists (an object schema that
lists properties and says nothing of `additionalProperties` allows no other key, a tuple
no item after its `prefixItems`). llguidance follows JSON Schema's open default, so
`grammar_text` first declares what each schema leaves unsaid as not allowed
(`declare_unlisted`). `--structured-outputs-config '{"backend": "guidance"}'` asks for
vLLM's `guidance` backend instead, which keeps JSON Schema's default (unless
`disable_additional_properties`); a schema that says `additionalProperties: true` allows
more keys under either.

Where each part runs:
- `grammar_text(params)`: the constraint as llguidance grammar text, and `check_grammar`
  to refuse a bad one (400 naming the field) before it reaches the engine; both need no
  tokenizer, so the API server checks without building one.
- `GrammarCompiler` (in the engine core): the tokenizer's token trie (built once, ~1 s for
  a 49k vocabulary, on the first constrained request), and one compiled matcher per
  distinct constraint kept in an LRU cache; a request gets a fresh copy of it.
- `GrammarMatcher` (per request, owned by the engine's `Request`): advanced by every
  token appended to the output, so its state follows the output tokens exactly (preemption
  and recompute keep it; nothing is resampled).
- `fill_bitmasks` / `apply_bitmasks` (in the sampler): every constrained row's mask is
  computed in one llguidance call (its threads, not a Python loop per token), then applied
  to the batch's logits in one vectorised pass. Rows without a grammar are untouched.

A matcher that reached an error state (a token it refused, e.g. EOS forced by a caller's
min_tokens against a finished grammar) stops constraining its row instead of masking
every token, and `GrammarMatcher.error` says why.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path

import llguidance
import torch

from hotswap.errors import InvalidArgument
from hotswap.sampling_params import StructuredOutputsParams

CACHE_SIZE = 128  # compiled constraints kept per engine
BACKENDS = ("auto", "guidance")  # llguidance is hotswap's one backend (vLLM: "guidance")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """vLLM's --structured-outputs-config: server-wide defaults for every constraint.
    `backend`: "auto" (vLLM's default: schemas allow only what they list) or "guidance"
    (vLLM's llguidance backend: JSON Schema's open objects, unless
    `disable_additional_properties`)."""

    backend: str = "auto"
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    enable_in_reasoning: bool = False  # constrain the thinking too (no wait for its end)

    @classmethod
    def from_json(cls, text: str | None) -> StructuredOutputsConfig:
        """Parse the flag's JSON; ValueError naming the bad key or value."""
        if not text:
            return cls()
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ValueError(f"--structured-outputs-config: not JSON ({e})") from None
        known = {f.name: f for f in fields(cls)}
        if not isinstance(data, dict) or set(data) - set(known):
            unknown = sorted(set(data) - set(known)) if isinstance(data, dict) else data
            raise ValueError(f"--structured-outputs-config: unknown keys {unknown}")
        if data.get("backend", "auto") not in BACKENDS:
            raise ValueError(
                f"--structured-outputs-config: backend {data['backend']!r} is not available "
                f"(hotswap uses llguidance: {', '.join(BACKENDS)})"
            )
        for name, value in data.items():
            if name != "backend" and not isinstance(value, bool):
                raise ValueError(f"--structured-outputs-config: {name} must be true or false")
        return cls(**data)

    def apply(self, params: StructuredOutputsParams | None) -> None:
        """The server's defaults on a request's constraint (a request's own true stays)."""
        if params is None:
            return
        params.disable_any_whitespace |= self.disable_any_whitespace
        params.disable_additional_properties |= self.disable_additional_properties
        open_objects = self.backend == "guidance" and not params.disable_additional_properties
        if open_objects and params.json is not None:
            params.json = _declared(params.json, allowed=True)


def grammar_text(params: StructuredOutputsParams) -> str:
    """The constraint as llguidance grammar text (vLLM's llguidance mapping: JSON with
    flexible whitespace unless `disable_any_whitespace`; a schema allows only what it
    lists unless it says otherwise, as under vLLM's default backend)."""
    whitespace = {"whitespace_flexible": not params.disable_any_whitespace}
    kind = params.kind
    try:
        if kind == "json":
            schema = declare_unlisted(_parsed(params.json), allowed=False)
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=whitespace)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=whitespace
            )
        if kind == "choice":
            return llguidance.grammar_from("choice", json.dumps(params.choice))
        if kind == "regex":
            return llguidance.grammar_from("regex", params.regex)
        return llguidance.grammar_from("grammar", params.grammar)
    except (ValueError, TypeError) as e:
        raise InvalidArgument(f"structured_outputs.{kind}", f"{kind}: {e}") from None


def check_grammar(params: StructuredOutputsParams) -> str:
    """The grammar text, or InvalidArgument naming `structured_outputs.<kind>` when
    llguidance refuses the constraint."""
    text = grammar_text(params)
    error = llguidance.LLMatcher.validate_grammar(text)
    if error:
        kind = params.kind
        raise InvalidArgument(f"structured_outputs.{kind}", f"{kind}: invalid constraint: {error}")
    return text


# Keywords whose value maps names to subschemas, and keywords whose value is a subschema
# or a list of them (2020-12, and draft 7's `definitions`, `dependencies`, tuple `items`).
# Nothing else is walked: `enum`, `const`, `default`, `examples` hold values, not schemas.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                "dependentSchemas", "dependencies")  # fmt: skip
_SUBSCHEMAS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "items",
               "prefixItems", "additionalItems", "unevaluatedItems", "contains", "not", "if",
               "then", "else", "allOf", "anyOf", "oneOf", "contentSchema")  # fmt: skip


def declare_unlisted(schema: object, allowed: bool) -> object:
    """`schema` (not modified) with what it leaves unsaid about unlisted members said, at
    every level: a (sub)schema that lists `properties` or `patternProperties` and
    declares neither `additionalProperties` nor `unevaluatedProperties` gets
    `additionalProperties: allowed`; a tuple (`prefixItems`, or draft 7's list of
    `items`) that declares nothing of the items after it gets `items` (draft 7:
    `additionalItems`) `allowed`. False is xgrammar's strict mode, vLLM's default; True
    is JSON Schema's own default, vLLM's `guidance` backend's."""
    if isinstance(schema, list):
        return [declare_unlisted(item, allowed) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: declare_unlisted(sub, allowed) for name, sub in out[key].items()}
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), (dict, list)):
            out[key] = declare_unlisted(out[key], allowed)
    lists = any(isinstance(out.get(key), dict) for key in ("properties", "patternProperties"))
    if lists and not {"additionalProperties", "unevaluatedProperties"} & out.keys():
        out["additionalProperties"] = allowed
    if "unevaluatedItems" not in out:
        if isinstance(out.get("prefixItems"), list) and "items" not in out:
            out["items"] = allowed
        elif isinstance(out.get("items"), list) and "additionalItems" not in out:
            out["additionalItems"] = allowed
    return out


def _parsed(schema: str | dict) -> object:
    return json.loads(schema) if isinstance(schema, str) else schema


def _declared(schema: str | dict, allowed: bool) -> str | dict:
    """`declare_unlisted` on a request's schema; JSON text that does not parse (or is not
    an object) is left as it is, for `grammar_text` to refuse naming the field."""
    try:
        declared = declare_unlisted(_parsed(schema), allowed)
    except ValueError:
        return schema
    return declared if isinstance(declared, dict) else schema


class GrammarMatcher:
    """One request's position in its grammar. With `start_after` (token ids), the grammar
    waits, neither masking nor consuming, until the output ends with them."""

    def __init__(self, matcher: llguidance.LLMatcher, start_after: Sequence[int] = ()) -> None:
        self.matcher = matcher
        self.start_after = list(start_after)
        self.recent: list[int] = []  # the output's last len(start_after) tokens, while waiting

    @property
    def waiting(self) -> bool:
        return bool(self.start_after)

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None

    @property
    def constrains(self) -> bool:
        """Whether this row's logits are masked now (not while waiting for its start, nor
        once the matcher erred)."""
        return not self.waiting and not self.matcher.is_error()

    def accept(self, token_id: int) -> bool:
        """Advance past a token appended to the output; False if the grammar refused it."""
        if self.waiting:
            self.recent = [*self.recent, token_id][-len(self.start_after) :]
            if self.recent == self.start_after:
                self.start_after, self.recent = [], []
            return True
        if self.matcher.is_error():
            return False
        return self.matcher.consume_token(token_id)

    def is_terminated(self) -> bool:
        return self.matcher.is_stopped()


class GrammarCompiler:
    """Compiles constraints against one tokenizer (the model's vocabulary size, its EOS as
    the token that ends a complete match). Thread-safe; the token trie is built lazily."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_id: int | None) -> None:
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    @classmethod
    def from_tokenizer_dir(cls, path: Path, vocab_size: int, eos_token_id: int | None):  # noqa: ANN206
        return cls((Path(path) / "tokenizer.json").read_text(), vocab_size, eos_token_id)

    def _tokenizer(self) -> llguidance.LLTokenizer:
        if self._ll_tokenizer is None:
            self._ll_tokenizer = llguidance.LLTokenizer(
                self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self.eos_token_id
            )
        return self._ll_tokenizer

    def matcher(self, params: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh matcher at the start of the constraint; InvalidArgument naming the field
        if llguidance cannot compile it."""
        text = grammar_text(params)
        with self._lock:
            template = self._cache.get(text)
            if template is None:
                template = llguidance.LLMatcher(self._tokenizer(), text, log_level=0)
                if template.is_error():
                    kind = params.kind
                    raise InvalidArgument(
                        f"structured_outputs.{kind}",
                        f"{kind}: invalid constraint: {template.get_error()}",
                    )
                self._cache[text] = template
                if len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(text)
            return GrammarMatcher(template.deep_copy(), params.start_after_token_ids or ())


class LazyGrammarCompiler:
    """The engine core's compiler, built on the first constrained request (the token trie
    takes ~1 s for a 49k vocabulary), so engines that never see one never pay for it.
    Every request of an engine comes from one tokenizer, so the first request's EOS is
    every request's."""

    def __init__(self, tokenizer_dir: Path, vocab_size: int) -> None:
        self.tokenizer_dir = Path(tokenizer_dir)
        self.vocab_size = vocab_size
        self.compiler: GrammarCompiler | None = None

    def matcher(self, params: StructuredOutputsParams, eos_token_id: int | None) -> GrammarMatcher:
        if self.compiler is None:
            self.compiler = GrammarCompiler.from_tokenizer_dir(
                self.tokenizer_dir, self.vocab_size, eos_token_id
            )
        return self.compiler.matcher(params)


_executor: llguidance.LLExecutor | None = None


def fill_bitmasks(matchers: list[GrammarMatcher], vocab_size: int) -> torch.Tensor:
    """[len(matchers), ceil(vocab / 32)] int32 masks (bit t of word t // 32 set: token t
    allowed), computed by llguidance in parallel."""
    global _executor
    if _executor is None:
        _executor = llguidance.LLExecutor()
    words = (vocab_size + 31) // 32
    bitmask = torch.empty((len(matchers), words), dtype=torch.int32)
    pairs = [(m.matcher, i) for i, m in enumerate(matchers)]
    _executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, len(matchers))
    return bitmask


_BITS = torch.arange(32, dtype=torch.int32)


def apply_bitmasks(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Set to -inf, in place, the logits of `rows` whose token's bit is clear."""
    vocab = logits.shape[-1]
    bits = (bitmask.to(logits.device)[:, :, None] >> _BITS.to(logits.device)) & 1
    allowed = bits.reshape(len(rows), -1)[:, :vocab].bool()
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
