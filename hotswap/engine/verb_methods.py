"""Client methods whose signatures are the verb table's (hotswap/engine/verbs.py).

`LLM`, `AsyncLLM` and the Ray engine actor have a method per control verb, made here from
the table (`with_verb_methods`): adding a verb adds it to every one of them. Each method's
parameters are its verb's arguments, read from the verb's Args struct: the same names, in
the declared order (so positional callers keep working), with the same defaults; its name
is the verb's (or the verb's `client_name`, e.g. `pause_generation`). A class keeps the
methods it writes itself. tests/engine/test_client_signatures.py fails if a method drifts.

One forwarding method is made by reference to its verb, with its transport and answer:

    finish_weight_update = verb_method(FinishWeightUpdate, answer=committed)

It binds its arguments, fills in the verb's defaults and calls `self.call(name, **arguments)`
with the verb's name (or the method named by `via`); `answer(result, arguments)` reshapes
the result. A method with a body of its own takes the verb's signature with
`@takes_verb_arguments(verb)`.
"""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from typing import Annotated, Any, TypeVar

import msgspec

from hotswap.engine.verbs import VERBS, Args, argument_fields, verb_name

# (the verb's result, the method's arguments by name) -> what the method returns
Answer = Callable[[Any, Mapping[str, Any]], Any]
F = TypeVar("F", bound=Callable[..., Any])
C = TypeVar("C", bound=type)

VERB_ATTRIBUTE = "__verb__"  # on every method made here: the name of the verb it invokes


@functools.cache
def verb_signature(verb: type[Args]) -> inspect.Signature:
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


def verb_arguments(
    verb: type[Args], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
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
    verb: type[Args],
    *,
    name: str | None = None,
    via: str = "call",
    answer: Answer | None = None,
    doc: str | None = None,
    coroutine: bool = False,
) -> Callable[..., Any]:
    """A method invoking `verb` through `self.<via>(its name, **arguments)`: blocking, or
    with `coroutine` one that awaits it (see async_verb_method)."""
    called = verb_name(verb)

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        arguments = verb_arguments(verb, args, kwargs)
        result = getattr(self, via)(called, **arguments)
        return result if answer is None else answer(result, arguments)

    async def coroutine_method(self: Any, *args: Any, **kwargs: Any) -> Any:
        arguments = verb_arguments(verb, args, kwargs)
        result = await getattr(self, via)(called, **arguments)
        return result if answer is None else answer(result, arguments)

    return _declared(coroutine_method if coroutine else method, verb, name, doc)


def async_verb_method(verb: type[Args], **options: Any) -> Callable[..., Any]:
    """`verb_method(verb, coroutine=True, **options)`: a coroutine method (AsyncLLM; Ray
    actors, whose coroutine methods Ray runs on the actor's event loop)."""
    return verb_method(verb, coroutine=True, **options)


def takes_verb_arguments(verb: type[Args]) -> Callable[[F], F]:
    """Decorator: the method takes `verb`'s arguments (as `verb_method`'s do) and its body
    receives every one of them by keyword, defaults filled in."""

    def decorate(body: F) -> F:
        @functools.wraps(body)
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return body(self, **verb_arguments(verb, args, kwargs))

        method.__signature__ = verb_signature(verb)  # type: ignore[attr-defined]
        setattr(method, VERB_ATTRIBUTE, verb_name(verb))
        return method  # type: ignore[return-value]

    return decorate


def with_verb_methods(*, coroutine: bool, via: str = "call") -> Callable[[C], C]:
    """Class decorator: a method for every verb of the table (`verb_method` through
    `self.<via>`, coroutines if `coroutine`), named `client_name` or the verb's name, except
    where the class (or a base) already has an attribute of that name: a method with a body
    of its own (e.g. one that takes tensors rather than the verb's inline form)."""

    def decorate(cls: C) -> C:
        for verb in VERBS.values():
            name = verb.client_name or verb_name(verb)
            if not hasattr(cls, name):
                setattr(cls, name, verb_method(verb, name=name, via=via, coroutine=coroutine))
        return cls

    return decorate


def _declared(
    method: Callable[..., Any], verb: type[Args], name: str | None, doc: str | None
) -> Callable[..., Any]:
    """`method` named and documented as the client method of `verb` it is."""
    called = verb_name(verb)
    if VERBS.get(called) is not verb:
        raise ValueError(f"{verb!r} is not a control verb (hotswap/engine/verbs.py)")
    method.__name__ = method.__qualname__ = name or called
    own = verb.__doc__  # not inspect.getdoc: it would inherit Args' docstring
    summary = doc or (inspect.cleandoc(own) if own else f"The `{called}` control verb.")
    method.__doc__ = (
        f"{summary}\n\nInvokes the `{called}` control verb; the arguments are the verb's, "
        "declared (with their constraints) in hotswap/engine/verbs.py."
    )
    method.__signature__ = verb_signature(verb)  # type: ignore[attr-defined]
    setattr(method, VERB_ATTRIBUTE, called)
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
