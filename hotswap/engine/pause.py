"""Pause and resume of generation (docs/design.md §3): the scheduler's pause state, and when a
pause call may return."""

from __future__ import annotations

from collections.abc import Callable

from hotswap.engine.errors import EngineStateError
from hotswap.engine.handlers import Deferred, Outputs, handles
from hotswap.engine.messages import EngineCoreOutput
from hotswap.engine.request_manager import RequestManager
from hotswap.engine.scheduler import PauseState, Scheduler
from hotswap.engine.verbs import IsPaused, Pause


class PauseManager:
    """Moves the scheduler between UNPAUSED, PAUSED_NEW (admit nothing new, let started
    requests finish) and PAUSED_ALL (schedule nothing; requests keep their place).

    Invariants: `pause` never loosens a stricter state (a `wait` pause during a `keep`
    pause stays PAUSED_ALL); a pause call answers only once `pause_complete()` holds, and
    the loop checks it between steps, never mid-step; only `unpause` loosens the state.
    A resume is deferred while the engine sleeps: `SleepManager.resume` owns that."""

    def __init__(
        self,
        scheduler: Scheduler,
        requests: RequestManager,
        weights_missing: Callable[[], bool] = lambda: False,
    ) -> None:
        self.scheduler = scheduler
        self.requests = requests
        self.weights_missing = weights_missing  # no step runs until weights are loaded

    def pause(self, mode: str, clear_cache: bool = True) -> list[EngineCoreOutput]:
        """Enter the pause state for `mode` (never loosening a stricter one). Returns the
        outputs of requests aborted by `abort` mode; `pause_complete()` tells when the
        caller may return, and `finish_pause()` must run then. A `wait` that could never
        end (started requests, and no step can run until weights are loaded again) is
        refused before anything changes."""
        if mode == "wait" and self.weights_missing() and self.scheduler.has_started_requests():
            raise EngineStateError(
                "mode: 'wait' would never return: started requests cannot finish while the "
                "weights are missing (discarded by sleep level 2, or an update failed "
                "midway); load weights first, or pause with mode 'keep' or 'abort'"
            )
        outputs = self.requests.abort(list(self.scheduler.requests)) if mode == "abort" else []
        wanted = PauseState.PAUSED_ALL if mode == "keep" else PauseState.PAUSED_NEW
        self.scheduler.set_pause_state(max(self.scheduler.pause_state, wanted))
        return outputs

    @handles(Pause)
    def on_pause(self, args: Pause, out: Outputs) -> Deferred:
        out.extend(self.pause(args.mode, args.clear_cache))
        return Deferred(lambda: self.finish_pause(args.clear_cache))

    def pause_complete(self) -> bool:
        """`keep`: at once (the loop only calls this between steps); `abort`/`wait`: when no
        started request remains; a resume that overtook the pause also ends the wait."""
        state = self.scheduler.pause_state
        return state != PauseState.PAUSED_NEW or not self.scheduler.has_started_requests()

    def finish_pause(self, clear_cache: bool) -> None:
        if clear_cache and self.scheduler.pause_state != PauseState.UNPAUSED:
            self.scheduler.drop_running_kv()
            self.requests.reset_prefix_cache()

    def pause_all(self) -> None:
        """Hold every request where it is (a sleep: requests frozen by it stay waiting)."""
        self.scheduler.set_pause_state(PauseState.PAUSED_ALL)

    def unpause(self) -> None:
        self.scheduler.set_pause_state(PauseState.UNPAUSED)

    def is_paused(self) -> bool:
        return self.scheduler.pause_state != PauseState.UNPAUSED

    @handles(IsPaused)
    def on_is_paused(self, args: IsPaused, out: Outputs) -> bool:
        return self.is_paused()
