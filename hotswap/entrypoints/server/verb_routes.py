"""HTTP routes as declarations over the control verbs (hotswap/engine/verbs.py).

A dialect (vLLM, SGLang, TRL, ...) is a list of `VerbRoute`s: the path, which verb it
invokes (its Args class), where its arguments come from (query string or JSON body), how
its wire names map onto the verb's arguments, and how the verb's answer is shaped. One
generic endpoint reads the input, validates it once (`verbs.make_args`), calls the engine
and answers; a refusal names the field in the route's own spelling (`body.weight_version`,
`query.mode`).

Unknown fields are ignored with a logged warning, as vLLM does (RL clients send fields they
don't need answered); `--reject-unknown-fields` makes them a 400.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import time
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import APIRouter, Request

from hotswap.engine import verbs
from hotswap.engine.errors import InvalidArgument
from hotswap.entrypoints.openai.params import warn_ignored_fields
from hotswap.entrypoints.server.errors import APIError, bad_request
from hotswap.entrypoints.server.limits import check_json, printable_field
from hotswap.entrypoints.server.state import get_engine, get_metrics, get_server_config
from hotswap.weight_transfer.backends import get_backend
from hotswap.weight_transfer.infos import InfoT, parse_info

logger = logging.getLogger(__name__)

Source = Literal["query", "body"]


@dataclass(frozen=True)
class Done:
    """A verb's answer as a route shapes it."""

    result: Any
    args: verbs.Args
    seconds: float


def _ok(done: Done) -> dict[str, Any]:
    return {"success": True}


@dataclass(frozen=True)
class VerbRoute:
    path: str
    verb: type[verbs.Args]
    method: str = "POST"
    source: Source = "body"  # a GET route reads its query string whatever this says
    # wire name -> the verb's argument, or a field inside one: "init_info.master_port" reads
    # the wire's master_port into init_info (names not listed are the verb's own). A refusal
    # of that field, or of anything inside it, names the wire's field.
    names: Mapping[str, str] = field(default_factory=dict)
    # The wire field a refusal of a verb field (a path) names where `translate` built that
    # field from others (master_port from PipelineRL's init method); beside `names`. The
    # wire field is named whole: a path inside the verb's field means nothing on the wire.
    sources: Mapping[str, str] = field(default_factory=dict)
    # Dialect-specific reshaping of the wire values into the verb's arguments (after
    # renaming); raises InvalidArgument with the wire name for values only it refuses.
    translate: Callable[[dict[str, Any]], dict[str, Any]] | None = None
    # Wire fields only `translate` reads (not the verb's own arguments).
    consumes: frozenset[str] = frozenset()
    # Wire fields a dialect sends that mean nothing here: accepted silently.
    ignored: frozenset[str] = frozenset()
    answer: Callable[[Done], Any] = _ok

    @property
    def location(self) -> Source:
        """Where the arguments are read from: a GET has no body."""
        return "query" if self.method == "GET" else self.source


def add_verb_routes(router: APIRouter, routes: Iterable[VerbRoute]) -> None:
    for route in routes:
        name = f"{verbs.verb_name(route.verb)} {route.path}"
        router.add_api_route(route.path, _endpoint(route), methods=[route.method], name=name)


def _endpoint(route: VerbRoute) -> Callable[[Request], Any]:
    async def endpoint(request: Request) -> Any:
        values = await read_values(request, route)
        args = route_args(route, values, info_backend(request, route.verb))
        return route.answer(await call_route(request, route, args))

    endpoint.__doc__ = f"{route.method} {route.path}: the `{verbs.verb_name(route.verb)}` verb."
    return endpoint


async def call_route(request: Request, route: VerbRoute, args: verbs.Args) -> Done:
    """Invoke the verb; the engine's own refusals name the field in the route's spelling."""
    start = time.perf_counter()
    try:
        result = await get_engine(request).call_with(args)
    except InvalidArgument as e:
        get_metrics(request).observe_verb(args, time.perf_counter() - start, ok=False)
        raise _refusal(route, e) from None
    except Exception:
        get_metrics(request).observe_verb(args, time.perf_counter() - start, ok=False)
        raise
    seconds = time.perf_counter() - start
    get_metrics(request).observe_verb(args, seconds)
    return Done(result, args, seconds)


async def read_values(request: Request, route: VerbRoute) -> dict[str, Any]:
    """The route's input as {wire name: value}; unknown names dropped (or refused)."""
    if route.location == "query":
        values = _query_values(request, route)
    else:
        values = await json_object(request)
    # An argument the route fills field by field (names "init_info.x") is not on its wire.
    filled = {path.partition(".")[0] for path in route.names.values() if "." in path}
    known = (set(_fields(route.verb)) - filled) | set(route.names) | route.consumes | route.ignored
    values = known_fields(request, values, known, route.location)
    return {k: v for k, v in values.items() if k not in route.ignored}


async def read_body_fields(request: Request, known: frozenset[str]) -> dict[str, Any]:
    """A JSON body's `known` fields, for routes written by hand (unknown ones as above)."""
    return known_fields(request, await json_object(request), known, "body")


def known_fields(
    request: Request, values: dict[str, Any], known: set[str] | frozenset[str], location: str
) -> dict[str, Any]:
    """`values` without unknown names: ignored with a throttled warning naming them (a
    query string's silently, as FastAPI does), or a 400 under --reject-unknown-fields."""
    unknown = sorted(set(values) - known)
    if unknown and get_server_config(request).reject_unknown_fields:
        name = printable_field(unknown[0])
        raise bad_request(f"{name}: unknown field (this server runs with "
                          f"--reject-unknown-fields)", f"{location}.{name}")  # fmt: skip
    if unknown and location == "body":
        warn_ignored_fields(request.url.path, unknown)
    return {k: v for k, v in values.items() if k in known}


def info_backend(request: Request, verb: type[verbs.Args]) -> str | None:
    """The backend whose structs type the verb's transfer info where its arguments are
    read (None: the engine checks it on receipt). An init's always; an update's only on a
    backend that does not stream: a stream's sender is already sending the chunk, so a
    chunk it cannot size must reach the engine, which refuses it and leaves the channel."""
    if verb not in (verbs.InitWeightTransfer, verbs.UpdateWeights):
        return None
    config = get_engine(request).config.weight_transfer
    if config is None:
        return None
    if verb is verbs.UpdateWeights and get_backend(config.backend).needs_init:
        return None
    return config.backend


def route_args(route: VerbRoute, values: dict[str, Any], backend: str | None = None) -> verbs.Args:
    """Rename, translate and validate (a transfer info as `backend`'s, if given); a
    refusal names the wire field."""
    try:
        renamed = _renamed(route, values)
        if route.translate is not None:
            renamed = route.translate(renamed)
        return verbs.make_args(route.verb, renamed, lax=route.location == "query", backend=backend)
    except InvalidArgument as e:
        raise _refusal(route, e) from None


def _renamed(route: VerbRoute, values: dict[str, Any]) -> dict[str, Any]:
    """`values` under the verb's names; a name declared as a field of an argument
    ("init_info.master_port") goes into that argument (one level: a transfer info's)."""
    renamed: dict[str, Any] = {}
    for name, value in values.items():
        arg, _, inner = route.names.get(name, name).partition(".")
        if inner:
            renamed.setdefault(arg, {})[inner] = value
        else:
            renamed[arg] = value
    return renamed


def route_info(route: VerbRoute, cls: type[InfoT], values: dict[str, Any]) -> dict[str, Any]:
    """A transfer info a route keeps for a later call (AReaL's meta, set before the update
    that sends it): `values` renamed into the route's one info argument and checked as
    `cls`; a refusal names the wire field. Returns the info as sent."""
    (arg,) = {path.partition(".")[0] for path in route.names.values()}
    info = _renamed(route, values).get(arg, {})
    try:
        parse_info(cls, info, arg)
    except InvalidArgument as e:
        raise _refusal(route, e) from None
    return info


def _refusal(route: VerbRoute, error: InvalidArgument) -> APIError:
    """The refusal in the route's spelling: the longest declared verb field the refused
    one lies in (`update_info.dtype_names` for `update_info.dtype_names[2]`) becomes its
    wire name (`dtypes[2]`); undeclared ones keep the verb's names."""
    if error.field is None:
        return bad_request(str(error))
    wire_names = {arg: name for name, arg in route.names.items()} | dict(route.sources)
    field = error.field
    head = _ARGUMENT.match(field).group(0)  # no declaration: the argument is its own name
    for path in sorted(wire_names, key=len, reverse=True):
        if field == path or (field.startswith(path) and field[len(path)] in ".["):
            head = path
            break
    wire, rest = wire_names.get(head, head), field[len(head) :]
    if head in route.sources:  # built from a wire field of another shape: name it whole
        rest = ""
    message = str(error)
    if wire != head and message.startswith(f"{head}{rest}:"):
        message = wire + message[len(head) :]
    return bad_request(message, f"{route.location}.{wire}{rest}")


_ARGUMENT = re.compile(r"[^.\[]*")


def _query_values(request: Request, route: VerbRoute) -> dict[str, Any]:
    fields = _fields(route.verb)
    params = request.query_params
    values: dict[str, Any] = {}
    for name in params:
        arg = route.names.get(name, name)
        is_list = arg in fields and _is_list(fields[arg])
        values[name] = params.getlist(name) if is_list else params[name]
    return values


def _fields(verb: type[verbs.Args]) -> dict[str, Any]:
    return {name: f.type for name, f in verbs.argument_fields(verb).items()}


def _is_list(field_type: Any) -> bool:
    origin = typing.get_origin(field_type)
    if origin in (typing.Union, types.UnionType):
        return any(_is_list(part) for part in typing.get_args(field_type))
    return origin is list


async def json_object(request: Request, allow_list: bool = False) -> Any:
    """An optional JSON object body (or list, if allowed): empty means {}. Strings are
    valid Unicode and nesting is bounded (see limits.json_problem)."""
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except ValueError:
        raise bad_request("Invalid JSON format", "body") from None
    except RecursionError:
        raise bad_request("body: JSON nested too deeply", "body") from None
    if not isinstance(body, dict) and not (allow_list and isinstance(body, list)):
        raise bad_request("body: must be a JSON object", "body")
    check_json(body)
    return body


async def call_verb(
    request: Request, route: VerbRoute, verb: type[verbs.Args], **values: Any
) -> Done:
    """Invoke another verb from a route that composes several (a dialect whose one call
    is a whole weight round); `values` use the verb's own names."""
    try:
        args = verbs.make_args(verb, values, backend=info_backend(request, verb))
    except InvalidArgument as e:
        raise _refusal(route, e) from None
    return await call_route(request, route, args)


async def weight_round(
    request: Request,
    route: VerbRoute,
    chunks: list[dict[str, Any]],
    weight_version: str | None = None,
    is_checkpoint_format: bool = True,
) -> Done:
    """A whole round in one call: start, receive each chunk (an `update_info`), commit.
    Any failure after the start aborts the round (the old weights keep serving, nothing
    is half-applied) and is raised as it was."""
    await call_verb(
        request, route, verbs.StartWeightUpdate, is_checkpoint_format=is_checkpoint_format
    )
    try:
        for chunk in chunks:
            await call_verb(request, route, verbs.UpdateWeights, update_info=chunk)
        return await call_verb(
            request, route, verbs.FinishWeightUpdate, weight_version=weight_version
        )
    except BaseException:
        with contextlib.suppress(Exception):
            await get_engine(request).finish_weight_update(abort=True)
        raise


def decimal_int(value: object) -> object:
    """An integer from the decimal string some trainers send (AReaL's master_port; SGLang's
    request model converts such strings); anything else as sent, for validation to refuse."""
    if isinstance(value, str) and re.fullmatch(r"[0-9]{1,10}", value.strip()):
        return int(value)
    return value
