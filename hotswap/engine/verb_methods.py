"""Client methods whose signatures are the verb table's (hotswap/engine/verbs.py).

`LLM`, `AsyncLLM`, the Ray engine actor and its trainer-side client, and `EngineGroup` offer
control verbs as named methods. Each such method's parameters are its verb's arguments, read
from the verb's Args struct: the same names, in the declared order (so today's positional
callers keep working), with the same defaults. A verb that gains an argument gains it on
every client at once; tests/engine/test_client_signatures.py fails if a method drifts.

A forwarding method is declared by reference, with its transport and answer:

    finish_weight_update = verb_method("finish_weight_update", answer=committed)

It binds its arguments, fills in the verb's defaults and calls `self.call(verb, **arguments)`
(or the method named by `via`); `answer(result, arguments)` reshapes the result. A method
whose Python name is not the verb's names it once (`name="pause_generation"`). A method
with a body of its own takes the verb's signature with `@takes_verb_arguments(verb)`.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from typing import Annotated, Any, TypeVar

import msgspec

from hotswap.engine.verbs import VERBS, argument_fields

# (the verb's result, the method's arguments by name) -> what the method returns
Answer = Callable[[Any, Mapping[str, Any]], Any]
F = TypeVar("F", bound=Callable[..., Any])

VERB_ATTRIBUTE = "__verb__"  # on every method made here: the verb it invokes


@functools.cache
def verb_signature(verb: str) -> inspect.Signature:
    """`(self, <the verb's arguments>)`: positional-or-keyword, in declared order, each with
    its declared default (a required argument has none)."""
    parameters = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for field in argument_fields(verb).values():
        parameters.append(
            inspect.Parameter(
                field.name,
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
                default=_default(field) if not field.required else inspect.Parameter.empty,
                annotation=_plain(field.type),
            )
        )
    return inspect.Signature(parameters)


def verb_arguments(verb: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """Every argument of the verb, from a call's positional and keyword arguments (without
    `self`) and the verb's defaults; TypeError as for any Python call that does not fit."""
    signature = verb_signature(verb)
    arguments = dict(signature.bind(None, *args, **kwargs).arguments)
    del arguments["self"]
    for name, field in argument_fields(verb).items():
        if name not in arguments:
            arguments[name] = _default(field)  # a fresh one each call: factories' lists
    return arguments


def verb_method(
    verb: str,
    *,
    name: str | None = None,
    via: str = "call",
    answer: Answer | None = None,
    doc: str | None = None,
    coroutine: bool = False,
) -> Callable[..., Any]:
    """A method invoking `verb` through `self.<via>(verb, **arguments)`: blocking, or with
    `coroutine` one that awaits it (see async_verb_method)."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        arguments = verb_arguments(verb, args, kwargs)
        result = getattr(self, via)(verb, **arguments)
        return result if answer is None else answer(result, arguments)

    async def coroutine_method(self: Any, *args: Any, **kwargs: Any) -> Any:
        arguments = verb_arguments(verb, args, kwargs)
        result = await getattr(self, via)(verb, **arguments)
        return result if answer is None else answer(result, arguments)

    return _declared(coroutine_method if coroutine else method, verb, name, doc)


def async_verb_method(verb: str, **options: Any) -> Callable[..., Any]:
    """`verb_method(verb, coroutine=True, **options)`: a coroutine method (AsyncLLM; Ray
    actors, whose coroutine methods Ray runs on the actor's event loop)."""
    return verb_method(verb, coroutine=True, **options)


def takes_verb_arguments(verb: str) -> Callable[[F], F]:
    """Decorator: the method takes `verb`'s arguments (as `verb_method`'s do) and its body
    receives every one of them by keyword, defaults filled in."""

    def decorate(body: F) -> F:
        @functools.wraps(body)
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return body(self, **verb_arguments(verb, args, kwargs))

        method.__signature__ = verb_signature(verb)  # type: ignore[attr-defined]
        setattr(method, VERB_ATTRIBUTE, verb)
        return method  # type: ignore[return-value]

    return decorate


def _declared(
    method: Callable[..., Any], verb: str, name: str | None, doc: str | None
) -> Callable[..., Any]:
    """`method` named and documented as the client method of `verb` it is."""
    if verb not in VERBS:
        raise ValueError(f"{verb!r} is not a control verb (hotswap/engine/verbs.py)")
    method.__name__ = method.__qualname__ = name or verb
    own = VERBS[verb].args.__doc__  # not inspect.getdoc: it would inherit Args' docstring
    summary = doc or (inspect.cleandoc(own) if own else f"The `{verb}` control verb.")
    method.__doc__ = (
        f"{summary}\n\nInvokes the `{verb}` control verb; the arguments are the verb's, "
        "declared (with their constraints) in hotswap/engine/verbs.py."
    )
    method.__signature__ = verb_signature(verb)  # type: ignore[attr-defined]
    setattr(method, VERB_ATTRIBUTE, verb)
    return method


def _plain(annotation: Any) -> Any:
    """The type without msgspec's constraints (Annotated metadata), for help() to show:
    the constraints are checked where the call enters (verbs.make_args)."""
    origin, parts = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        return _plain(parts[0])
    if origin in (typing.Union, types.UnionType):
        return typing.Union[tuple(_plain(p) for p in parts)]  # noqa: UP007
    return annotation


def _default(field: msgspec.structs.FieldInfo) -> Any:
    return field.default_factory() if field.default is msgspec.NODEFAULT else field.default
