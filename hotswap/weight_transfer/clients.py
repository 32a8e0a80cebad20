"""How a trainer drives the engine's four phases: over HTTP (`hotswap serve`) or in
process (`AsyncLLM` / `LLM`). Only JSON metadata travels here; tensors take the data
plane of the chosen backend."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import httpx


@dataclass(frozen=True)
class CommittedWeights:
    """What one finished round committed on an engine, from the engine's answer to the
    commit itself: the integer `version` its outputs' provenance spans (and
    `CompletionOutput.token_versions`) use, the `label`, and `digest` (blake2b of the
    loaded weights, as /weight_info reports) when asked for, else None."""

    version: int
    label: str
    digest: str | None = None
    # vLLM's per-tensor SHA-256 checksums, keyed by rank and name, when asked for (`checksum`)
    checksums: dict[str, str] | None = None
    # A round into a LoRA adapter: its name and the adapter version committed (the one
    # the outputs' spans name in `lora_version`); `version` is then the weights' own.
    lora_name: str | None = None
    lora_version: int | None = None

    @classmethod
    def from_answer(cls, answer: dict[str, Any]) -> CommittedWeights:
        """From an engine's answer: HTTP's shape (`weight_version` is the label) or the
        in-process one (`label`)."""
        label = answer.get("label", answer.get("weight_version"))
        version, digest = answer.get("version"), answer.get("digest")
        if not isinstance(version, int) or isinstance(version, bool) or not isinstance(label, str):
            raise WeightSyncError(f"finish_weight_update: the engine's answer names no commit: "
                                  f"{answer!r}")  # fmt: skip
        checksums = answer.get("checksums")
        return cls(version, label, digest if isinstance(digest, str) else None,
                   checksums if isinstance(checksums, dict) else None,
                   answer.get("lora_name"), answer.get("lora_version"))  # fmt: skip


def committed(answer: Any, arguments: Mapping[str, Any]) -> CommittedWeights | None:
    """What a client's `finish_weight_update` returns from the engine's answer: None for
    an abort, else what was committed."""
    return None if arguments.get("abort") else CommittedWeights.from_answer(answer)


@dataclass(frozen=True)
class GroupCommittedWeights:
    """What one group commit committed: `engines[i]` is engine i's own answer (None from a
    client that reports nothing). The label is common to all; integer versions are each
    engine's own counter, so `version` is the common one, or None if the engines count
    differently (e.g. one was restarted): then read the per-token versions of engine i's
    outputs against `engines[i].version`."""

    label: str | None
    engines: tuple[CommittedWeights | None, ...]

    @property
    def version(self) -> int | None:
        return _common([e.version if e is not None else None for e in self.engines])

    @property
    def digest(self) -> str | None:
        """The engines' common digest; None unless every engine gave the same one."""
        return _common([e.digest if e is not None else None for e in self.engines])


def _common(values: list[Any]) -> Any:
    """The one value all entries share, or None."""
    return values[0] if values and values[0] is not None and len(set(values)) == 1 else None


def adapter_round(lora_name: str | None, lora_config: dict[str, Any] | None) -> dict[str, Any]:
    """A start's arguments for a round into a LoRA adapter (none for the weights' round, so
    a client of the plain protocol need not take them)."""
    return {"lora_name": lora_name, "lora_config": lora_config} if lora_name else {}


# What a commit returns: one engine's answer, or an EngineGroup's (one per engine).
Committed = CommittedWeights | GroupCommittedWeights


class WeightSyncError(RuntimeError):
    """The engine refused or failed a weight-sync call (the engine's reason inside)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class WeightSyncClient(Protocol):
    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None: ...

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None: ...

    def update_weights(self, update_info: dict[str, Any]) -> None: ...

    def finish_weight_update(
        self, weight_version: str | None = None, abort: bool = False
    ) -> Committed | None:
        """Commit (returns what was committed) or abort (returns None). The least a client
        takes; hotswap's own take the verb's every argument (`digest=True` then hashes the
        committed weights, `checksum=True` adds per-tensor checksums, `kv_policy`)."""
        ...


class PreparingWeightSyncClient(WeightSyncClient, Protocol):
    """A client whose engine can check a round before committing it (for EngineGroup)."""

    def prepare_weight_update(self) -> None: ...

    def get_world_size(self) -> int: ...

    def weight_info(self) -> dict[str, Any]: ...


class VerbClient:
    """The weight-sync methods of hotswap's own clients (HTTP, in-process), declared once:
    each invokes the verb of its name (`weight_info`: get_weight_info) through the
    subclass's `_verb`. Their parameters are the verbs' (hotswap/engine/verbs.py), written
    out because this layer sits below the engine's and cannot read the verb table;
    tests/engine/test_client_signatures.py holds them to it."""

    def _verb(self, verb: str, **arguments: Any) -> Any:
        raise NotImplementedError

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._verb("init_weight_transfer_engine", init_info=init_info)

    def start_weight_update(
        self,
        is_checkpoint_format: bool = True,
        lora_name: str | None = None,
        lora_config: dict[str, Any] | None = None,
    ) -> None:
        self._verb("start_weight_update", is_checkpoint_format=is_checkpoint_format,
                   **adapter_round(lora_name, lora_config))  # fmt: skip

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._verb("update_weights", update_info=update_info)

    def prepare_weight_update(self) -> None:
        self._verb("prepare_weight_update")

    def finish_weight_update(
        self,
        weight_version: str | None = None,
        abort: bool = False,
        digest: bool = False,
        checksum: bool = False,
        kv_policy: str | None = None,
    ) -> CommittedWeights | None:
        """Commit the round labelled `weight_version` (returns what was committed, with
        the weights' `digest` and per-tensor `checksums` when asked for) or abort it
        (returns None)."""
        # The options only when asked: an older server refuses a field it does not know.
        options = {"digest": digest, "checksum": checksum, "kv_policy": kv_policy}
        arguments = {"weight_version": weight_version, "abort": abort,
                     **{k: v for k, v in options.items() if v not in (None, False)}}  # fmt: skip
        return committed(self._verb("finish_weight_update", **arguments), arguments)

    def get_world_size(self) -> int:
        return int(self._verb("get_world_size"))

    def weight_info(self) -> dict[str, Any]:
        """{version, label, digest} of the loaded weights (the get_weight_info verb)."""
        return self._verb("get_weight_info")


class HTTPWeightSyncClient(VerbClient):
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)

    def _verb(self, verb: str, **arguments: Any) -> Any:
        """The verb's route of `hotswap serve` (hotswap/entrypoints/vllm/routes.py; this
        layer cannot import it): POST /<verb> with the arguments given a value, or GET."""
        path = _PATHS.get(verb, f"/{verb}")
        if verb in _GET_VERBS:
            return self._get(path)
        body = {k: v for k, v in arguments.items() if v is not None}
        return self._post(path, body or None)

    def _post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        return _checked(path, self.http.post(path, json=body))

    def _get(self, path: str) -> dict[str, Any]:
        return _checked(path, self.http.get(path))

    def get_world_size(self) -> int:
        return int(self._get("/get_world_size")["world_size"])  # the route wraps the count

    def close(self) -> None:
        self.http.close()


# The routes that are not POST /<verb>.
_PATHS = {"get_weight_info": "/weight_info"}
_GET_VERBS = frozenset({"get_weight_info", "get_world_size"})


def _checked(path: str, response: httpx.Response) -> dict[str, Any]:
    """The JSON body of a 200; otherwise WeightSyncError with the engine's reason."""
    if response.status_code != 200:
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text
        raise WeightSyncError(f"{path}: HTTP {response.status_code}: {message}",
                              response.status_code)  # fmt: skip
    return response.json()


class InProcessWeightSyncClient(VerbClient):
    """Drives an `AsyncLLM` (from any thread but its event loop's: trainer code is
    blocking) or an `LLM` in this process."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def _verb(self, verb: str, **arguments: Any) -> Any:
        """The engine's method of the verb's name (LLM's and AsyncLLM's take its arguments)."""
        result = getattr(self.llm, verb)(**arguments)
        if not asyncio.iscoroutine(result):
            return result
        loop = getattr(self.llm, "_loop", None)
        if loop is None:
            result.close()
            raise RuntimeError("AsyncLLM has not started yet: run a request or call first")
        return asyncio.run_coroutine_threadsafe(result, loop).result()
