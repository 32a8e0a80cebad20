"""How a trainer drives the engine's four phases: over HTTP (`hotswap serve`) or in
process (`AsyncLLM` / `LLM`). Only JSON metadata travels here; tensors take the data
plane of the chosen backend."""

from __future__ import annotations

import asyncio
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

    @classmethod
    def from_answer(cls, answer: dict[str, Any]) -> CommittedWeights:
        """From an engine's answer: HTTP's shape (`weight_version` is the label) or the
        in-process one (`label`)."""
        label = answer.get("label", answer.get("weight_version"))
        version, digest = answer.get("version"), answer.get("digest")
        if not isinstance(version, int) or isinstance(version, bool) or not isinstance(label, str):
            raise WeightSyncError(f"finish_weight_update: the engine's answer names no commit: "
                                  f"{answer!r}")  # fmt: skip
        return cls(version, label, digest if isinstance(digest, str) else None)


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
        """Commit (returns what was committed) or abort (returns None). Clients that can
        also take `digest=True` (all of hotswap's) then hash the committed weights."""
        ...


class PreparingWeightSyncClient(WeightSyncClient, Protocol):
    """A client whose engine can check a round before committing it (for EngineGroup)."""

    def prepare_weight_update(self) -> None: ...

    def get_world_size(self) -> int: ...

    def weight_info(self) -> dict[str, Any]: ...


class HTTPWeightSyncClient:
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=base_url.rstrip("/"), headers=headers, timeout=timeout)

    def _post(self, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        return _checked(path, self.http.post(path, json=body))

    def _get(self, path: str) -> dict[str, Any]:
        return _checked(path, self.http.get(path))

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post("/init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        self._post("/start_weight_update", {"is_checkpoint_format": is_checkpoint_format})

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._post("/update_weights", {"update_info": update_info})

    def prepare_weight_update(self) -> None:
        self._post("/prepare_weight_update")

    def get_world_size(self) -> int:
        return int(self._get("/get_world_size")["world_size"])

    def finish_weight_update(
        self,
        weight_version: str | None = None,
        abort: bool = False,
        digest: bool = False,
        kv_policy: str | None = None,
    ) -> CommittedWeights | None:
        body: dict[str, Any] = {"abort": abort}
        if weight_version is not None:
            body["weight_version"] = weight_version
        if digest:  # only when asked: an older server would refuse the unknown field
            body["digest"] = True
        if kv_policy is not None:
            body["kv_policy"] = kv_policy
        answer = self._post("/finish_weight_update", body)
        return None if abort else CommittedWeights.from_answer(answer)

    def weight_info(self) -> dict[str, Any]:
        return self._get("/weight_info")

    def close(self) -> None:
        self.http.close()


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


class InProcessWeightSyncClient:
    """Drives an `AsyncLLM` (from any thread but its event loop's: trainer code is
    blocking) or an `LLM` in this process."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def _run(self, method: str, *args: Any) -> Any:
        result = getattr(self.llm, method)(*args)
        if not asyncio.iscoroutine(result):
            return result
        loop = getattr(self.llm, "_loop", None)
        if loop is None:
            result.close()
            raise RuntimeError("AsyncLLM has not started yet: run a request or call first")
        return asyncio.run_coroutine_threadsafe(result, loop).result()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._run("init_weight_transfer_engine", init_info)

    def start_weight_update(self, is_checkpoint_format: bool = True) -> None:
        self._run("start_weight_update", is_checkpoint_format)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._run("update_weights", update_info)

    def prepare_weight_update(self) -> None:
        self._run("prepare_weight_update")

    def finish_weight_update(
        self,
        weight_version: str | None = None,
        abort: bool = False,
        digest: bool = False,
        kv_policy: str | None = None,
    ) -> CommittedWeights | None:
        answer = self._run("finish_weight_update", weight_version, abort, digest, kv_policy)
        return None if abort else CommittedWeights.from_answer(answer)

    def get_world_size(self) -> int:
        return int(self._run("get_world_size"))

    def weight_info(self) -> dict[str, Any]:
        return self._run("get_weight_info")
