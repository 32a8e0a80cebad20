"""Errors every layer raises to its callers: a leaf module, below the model, the weight
transfer and the engine."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class InvalidArgument(ValueError):
    """The caller's input was refused (HTTP 400); nothing was changed. `field` names the
    argument at fault, dotted for nested ones (`init_info.master_port`), or None when no
    single one is; so no layer parses the message to find it."""

    def __init__(self, field: str | None, message: str) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self):  # noqa: ANN204 - pickled (e.g. by Ray) with its field
        return type(self), (self.field, str(self))


@contextlib.contextmanager
def nested(prefix: str) -> Iterator[None]:
    """Inside, a refused argument is one part of `prefix` (the argument being parsed
    there): an InvalidArgument's field becomes `prefix.field` (`prefix` when it named
    none), its message unchanged. For a low-level check that names the field it knows,
    under a caller that knows where that field came from."""
    try:
        yield
    except InvalidArgument as e:
        e.field = prefix if e.field is None else f"{prefix}.{e.field}"
        raise
