"""Every client's control methods take their verb's arguments (hotswap/engine/verbs.py):
the same names, in the same order, with the same defaults. The methods are collected
generically (any public method named after a verb, or made by verb_methods.py), so a new
verb or a new client is covered without touching this file."""

from __future__ import annotations

import asyncio
import functools
import inspect
import json
from typing import Any

import httpx
import msgspec
import pytest

from hotswap.engine.async_llm import AsyncLLM
from hotswap.engine.llm import LLM
from hotswap.engine.verb_methods import (
    VERB_ATTRIBUTE,
    async_verb_method,
    takes_verb_arguments,
    verb_method,
)
from hotswap.engine.verbs import (
    VERBS,
    FinishWeightUpdate,
    LoadWeightsFromDisk,
    Pause,
    Sleep,
    argument_fields,
)
from hotswap.rl.engine_group import EngineGroup
from hotswap.weight_transfer.clients import (
    CommittedWeights,
    HTTPWeightSyncClient,
    InProcessWeightSyncClient,
    PreparingWeightSyncClient,
    VerbClient,
    WeightSyncClient,
    committed,
)

# Hand-written methods whose Python name is not their verb's.
ALIASES = {
    "pause_generation": "pause",
    "resume_generation": "resume",
    "weight_info": "get_weight_info",
}
# Methods named after a verb that deliberately take other arguments, and why.
EXEMPT = {
    "collective_rpc": "vLLM's signature: a client-side `timeout`, `args` as a tuple",
    "load_lora_adapter": "vLLM's arguments; AsyncLLM runs the verb's `prepare` phase itself",
}
# Protocols declare the least a third-party client must take: a prefix of the verb's.
PROTOCOLS = (WeightSyncClient, PreparingWeightSyncClient)


def clients() -> list[type]:
    found = [LLM, AsyncLLM, VerbClient, HTTPWeightSyncClient, InProcessWeightSyncClient,
             EngineGroup, *PROTOCOLS]  # fmt: skip
    try:
        from hotswap.ray.actor import EngineActor
        from hotswap.ray.group import RayEngineClient, RayEngineGroup
    except ImportError:  # Ray is optional
        return found
    return [*found, EngineActor, RayEngineClient, RayEngineGroup]


def verb_methods(cls: type) -> dict[str, str]:
    """The class's control methods: Python name -> verb."""
    methods = {}
    for name, member in inspect.getmembers(cls, callable):
        verb = getattr(member, VERB_ATTRIBUTE, None) or ALIASES.get(name, name)
        if not name.startswith("_") and verb in VERBS and name not in EXEMPT:
            methods[name] = verb
    return methods


def described(parameters: list[inspect.Parameter]) -> list[tuple[str, Any]]:
    """(name, default) of each parameter after self; keyword-only ones must be too. Ray
    adds `_ray_trace_ctx` to an actor class's methods once the class is made remote."""
    return [(p.name, p.default) for p in parameters
            if p.kind is not p.VAR_KEYWORD and p.name != "_ray_trace_ctx"]  # fmt: skip


def verb_parameters(verb: str) -> list[tuple[str, Any]]:
    def default(f: msgspec.structs.FieldInfo) -> Any:
        if f.required:
            return inspect.Parameter.empty
        return f.default_factory() if f.default is msgspec.NODEFAULT else f.default

    return [(f.name, default(f)) for f in argument_fields(verb).values()]


@pytest.mark.parametrize("cls", clients(), ids=lambda c: c.__name__)
def test_control_methods_take_their_verbs_arguments(cls: type) -> None:
    methods = verb_methods(cls)
    assert methods, f"{cls.__name__}: no control methods found"
    for name, verb in methods.items():
        signature = inspect.signature(getattr(cls, name))
        parameters = list(signature.parameters.values())
        assert parameters[0].name == "self", f"{cls.__name__}.{name}"
        assert all(p.kind is not p.POSITIONAL_ONLY for p in parameters), f"{cls.__name__}.{name}"
        ours, theirs = described(parameters[1:]), verb_parameters(verb)
        if cls in PROTOCOLS:
            theirs = theirs[: len(ours)]
        assert ours == theirs, f"{cls.__name__}.{name} differs from the {verb!r} verb"


def test_finish_takes_checksum_everywhere() -> None:
    for cls in clients():
        if cls not in PROTOCOLS:
            parameters = inspect.signature(cls.finish_weight_update).parameters
            assert "checksum" in parameters, cls.__name__


def test_generated_methods_are_documented() -> None:
    doc = inspect.getdoc(AsyncLLM.finish_weight_update) or ""
    assert "commit version + 1" in doc and "finish_weight_update" in doc
    assert AsyncLLM.pause_generation.__name__ == "pause_generation"
    assert inspect.iscoroutinefunction(AsyncLLM.finish_weight_update)


class Recorder:
    """A transport that records what it was asked."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []

    def call(self, verb: str, **arguments: Any) -> Any:
        self.calls.append((verb, arguments))
        return {"version": 2, "label": "v2", "checksums": {"0.w": "ab"}}

    finish = verb_method(FinishWeightUpdate, name="finish", answer=committed)
    load = verb_method(LoadWeightsFromDisk)

    @takes_verb_arguments(Pause)
    def pause(self, *, mode: str, clear_cache: bool) -> tuple[str, bool]:
        return mode, clear_cache


def test_arguments_bind_positionally_and_by_name_with_defaults() -> None:
    r = Recorder()
    assert r.finish("v2", False, checksum=True) == CommittedWeights(2, "v2", None, {"0.w": "ab"})
    assert r.calls[-1] == ("finish_weight_update", {"weight_version": "v2", "abort": False,
                           "digest": False, "checksum": True, "kv_policy": None})  # fmt: skip
    assert r.finish(abort=True) is None
    with pytest.raises(TypeError):
        r.load()  # model_path is required
    with pytest.raises(TypeError):
        r.finish(nonsense=1)
    assert r.pause() == ("abort", True) and r.pause("keep") == ("keep", True)


def test_async_method_awaits_its_transport() -> None:
    class Async:
        async def call(self, verb: str, **arguments: Any) -> Any:
            return verb, arguments

        sleep = async_verb_method(Sleep)

    assert asyncio.run(Async().sleep(2)) == ("sleep", {"level": 2, "mode": "abort"})


def test_in_process_client_sends_checksum() -> None:
    r = Recorder()
    # The LLM's method of the verb's name, recorded.
    r.finish_weight_update = functools.partial(r.call, "finish_weight_update")  # type: ignore[attr-defined]
    answer = InProcessWeightSyncClient(r).finish_weight_update("v2", checksum=True)
    assert answer is not None and answer.checksums == {"0.w": "ab"}
    assert r.calls[-1][1] == {"weight_version": "v2", "abort": False, "checksum": True}


def test_http_client_sends_only_the_options_asked_for() -> None:
    sent: list[tuple[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        sent.append((request.url.path, json.loads(request.content) if request.content else None))
        return httpx.Response(200, json={"version": 1, "label": "v1", "world_size": 1})

    client = HTTPWeightSyncClient("http://engine")
    client.http = httpx.Client(base_url="http://engine", transport=httpx.MockTransport(handler))
    client.finish_weight_update("v1", checksum=True)
    client.finish_weight_update()
    client.prepare_weight_update()
    assert client.get_world_size() == 1
    assert sent == [
        ("/finish_weight_update", {"weight_version": "v1", "abort": False, "checksum": True}),
        ("/finish_weight_update", {"abort": False}),
        ("/prepare_weight_update", None),
        ("/get_world_size", None),
    ]
