"""How a control verb finds what it does: `@handles(Verb)` on a method of the manager that
owns the state the verb reads or changes (pause.py, sleep.py, weights/manager.py, ...).

A handler gets the verb's (already validated) arguments and the list to append outputs to
(requests the call aborted); it returns the call's answer, or `Deferred` when the answer
must wait for a condition the engine-core loop checks between steps (a pause completes
when its mode's condition holds). `handler_table` reads the handlers off the managers'
classes, one per declared verb (a verb without one, or with two, is refused when the table
is made: at import); `bind` gives an engine core's managers' handlers by argument class,
which the loop and `LLM` dispatch by.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from hotswap.engine.messages import EngineCoreOutput
from hotswap.engine.verbs import VERBS, Args, verb_name

Outputs = list[EngineCoreOutput]
# A manager's method bound to its manager: (the verb's arguments, outputs) -> the answer
Handler = Callable[[Any, Outputs], object]
F = TypeVar("F", bound=Callable[..., Any])

HANDLES = "__handles__"  # on a handler method: the verb (its Args class) it handles


@dataclass(frozen=True)
class Deferred:
    """Answer once the core's pause is complete (`EngineCore.pause_complete()`);
    `complete` then finishes the call (clears caches, frees memory) and gives its answer."""

    complete: Callable[[], object]


def handles(verb: type[Args]) -> Callable[[F], F]:
    """Decorator: this method of a manager (self, args, out) handles `verb`."""

    def mark(method: F) -> F:
        setattr(method, HANDLES, verb)
        return method

    return mark


def handler_table(managers: Iterable[type]) -> dict[str, tuple[type, str]]:
    """verb name -> (the manager class, the name of its method) handling it: every
    declared verb exactly once (TypeError otherwise)."""
    table: dict[str, tuple[type, str]] = {}
    for manager in managers:
        for name, member in vars(manager).items():
            verb = getattr(member, HANDLES, None)
            if verb is None:
                continue
            if verb_name(verb) in table:
                other = table[verb_name(verb)]
                raise TypeError(f"{verb.__name__}: handled twice, by {other[0].__name__}."
                                f"{other[1]} and {manager.__name__}.{name}")  # fmt: skip
            table[verb_name(verb)] = (manager, name)
    missing = sorted(set(VERBS) - set(table))
    if missing:
        raise TypeError(f"control verbs without a handler: {', '.join(missing)}")
    return table


def bind(table: dict[str, tuple[type, str]], managers: Iterable[object]) -> dict[type, Handler]:
    """The handlers of the managers among `managers` (one instance of each class in
    `table`; other objects are passed over), by the verb's Args class."""
    by_class = {type(manager): manager for manager in managers}
    return {VERBS[verb]: getattr(by_class[cls], name) for verb, (cls, name) in table.items()}
