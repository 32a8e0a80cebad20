"""The trainer's side of engine actors: `RayEngineClient` drives one `EngineActor` through
the weight-sync client protocol, `RayEngineGroup` drives several with `EngineGroup`'s
guarantees (phases fan out at once, broadcast ranks in order, prepare everywhere then
commit, or abort everywhere). Both carry ObjectRefs, so the `ray` backend works through
them; any other backend works too (gloo, nccl, ipc: the bytes take their own channel).

A dead actor surfaces as `EngineActorDiedError` naming it; the group then aborts the round
on every other engine, which keep serving their previous weights."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from hotswap.engine.verb_methods import with_verb_methods
from hotswap.engine.verbs import Args, LoadLoraAdapter
from hotswap.lora.request import LoRARequest
from hotswap.outputs import RequestOutput
from hotswap.rl.engine_group import EngineGroup
from hotswap.sampling_params import SamplingParams
from hotswap.weight_transfer.clients import VerbClient, WeightSyncError


class EngineActorDiedError(WeightSyncError):
    """The engine actor `name` died (or could not be reached) during a call."""

    def __init__(self, name: str, cause: BaseException) -> None:
        super().__init__(f"engine actor {name!r} died: {_first_line(cause)}")
        self.name = name


class RayEngineClient(VerbClient):
    """One engine actor as a weight-sync client (blocking calls, for trainer code): the
    protocol's methods (VerbClient's) call the actor's method of each verb's name."""

    accepts_object_refs = True  # the ray backend may pass ObjectRefs in update infos

    def __init__(self, actor: ActorHandle, name: str | None = None,
                 timeout_s: float | None = None) -> None:  # fmt: skip
        self.actor = actor
        self.name = name or _actor_name(actor)
        self.timeout_s = timeout_s

    def get(self, ref: Any) -> Any:
        """`ray.get`, with the engine's own exception re-raised (InvalidArgument,
        EngineStateError, ...) and a dead actor named."""
        try:
            return ray.get(ref, timeout=self.timeout_s)
        except RayActorError as e:
            raise EngineActorDiedError(self.name, e) from None
        except GetTimeoutError as e:
            raise WeightSyncError(f"engine actor {self.name!r}: no answer in "
                                  f"{self.timeout_s} s") from e  # fmt: skip
        except RayTaskError as e:
            cause = e.cause
            if isinstance(cause, Exception):
                raise cause from None
            raise

    def call(self, verb: str | type[Args], **arguments: Any) -> Any:
        return self.get(self.actor.call.remote(verb, **arguments))

    def _verb(self, verb: str, **arguments: Any) -> Any:
        """The actor's method of the verb's name (EngineActor's take its arguments; with
        the ray backend an update's info holds an ObjectRef)."""
        return self.get(getattr(self.actor, verb).remote(**arguments))


@with_verb_methods(coroutine=False)
class RayEngineGroup(EngineGroup):
    """`EngineGroup` over engine actors: give it to
    `WeightTransferTrainerFactory.trainer_init(..., client=group)` and one `send_weights()`
    updates every actor with a two-phase commit. Also fans generation and control out: a
    method per verb besides the weight-sync protocol's (made by with_verb_methods through
    `call`) answers every engine's answer, in engine order."""

    accepts_object_refs = True

    def __init__(
        self,
        actors: Sequence[ActorHandle],
        world_sizes: Sequence[int] | None = None,
        timeout_s: float | None = None,
        names: Sequence[str] | None = None,
    ) -> None:
        """`actors`: handles, or what `launch_engines` returned (its names are used);
        `timeout_s` bounds each call to an actor (None: wait)."""
        names = list(names or getattr(actors, "names", None) or [None] * len(actors))
        clients = [RayEngineClient(a, n, timeout_s) for a, n in zip(actors, names)]
        super().__init__(clients, world_sizes)
        self.names = [c.name for c in self.clients]
        self._calls = ThreadPoolExecutor(len(self.clients), "hotswap-ray-group-calls")

    @property
    def actors(self) -> list[ActorHandle]:
        return [c.actor for c in self.clients]

    def call(self, verb: str | type[Args], **arguments: Any) -> list[Any]:
        """A control verb (its class, or its name) on every engine at once (e.g. Pause
        with mode="keep"); the answers in engine order. The first failure is raised once
        all have answered."""
        refs = [c.actor.call.remote(verb, **arguments) for c in self.clients]
        futures = [self._calls.submit(c.get, ref) for c, ref in zip(self.clients, refs)]
        return [f.result() for f in futures]

    def load_lora_adapter(
        self, lora_name: str, lora_path: str, load_inplace: bool = False
    ) -> list[Any]:
        """Load an adapter on every engine in two phases: each checks and holds it, then
        all serve it; if any refuses, the load is dropped everywhere (each engine keeps
        what it had) and the refusal raised. The engines' answers, in order."""
        try:
            self.call(LoadLoraAdapter, lora_name=lora_name, lora_path=lora_path,
                      load_inplace=load_inplace, prepare=True)  # fmt: skip
        except BaseException:
            with contextlib.suppress(Exception):
                self.commit_lora_adapter(lora_name, abort=True)
            raise
        return self.commit_lora_adapter(lora_name)

    def generate(
        self,
        prompts: Sequence[Any],
        sampling_params: SamplingParams | dict[str, Any] | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[RequestOutput]:
        """Final outputs in prompt order; prompts are dealt out to the engines in turn and
        each engine runs its share as one batch (on `lora_request`'s adapter, if given)."""
        shares: list[list[int]] = [list(range(i, len(prompts), len(self.clients)))
                                   for i in range(len(self.clients))]  # fmt: skip
        work = [
            (
                c,
                share,
                c.actor.generate_many.remote(
                    [prompts[i] for i in share], sampling_params, lora_request
                ),
            )  # fmt: skip
            for c, share in zip(self.clients, shares)
            if share
        ]
        outputs: list[RequestOutput | None] = [None] * len(prompts)
        for client, share, ref in work:
            for index, output in zip(share, client.get(ref)):
                outputs[index] = output
        return outputs  # type: ignore[return-value]

    def close(self) -> None:
        super().close()
        self._calls.shutdown(wait=False)


def _actor_name(actor: ActorHandle) -> str:
    return f"actor {actor._actor_id.hex()[:12]}"


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
