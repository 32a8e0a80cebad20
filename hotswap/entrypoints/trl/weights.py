"""TRL's weight plane over the control verbs: the communicator (the engine's broadcast
group, the trainer as the last rank), one round per /update_named_param/, and the work
each answer leaves running behind it.

Round semantics: each /update_named_param/ is one round of one tensor. The route validates
the parameter (format, then name, shape and dtype kind against the model) and opens the
round before it answers, so a bad parameter is a 400 naming the field while the trainer
has not sent anything; the receive and the commit then run behind the answer (the trainer
only broadcasts once answered). Every commit applies that one tensor and bumps the weight
version (label unchanged): /weight_info counts one version per parameter, as vLLM applies
each parameter at once. The next TRL call waits for that commit; a failure behind an answer
(a transport error, the trainer gone) is that next call's answer (400/409, never a 5xx
TRL's client would retry into success). Under `require_complete` a one-tensor round cannot
commit: /init_communicator/ is then refused.

On CPU, TRL's client cannot run (PyNccl is CUDA-only): hotswap.weight_transfer.trl_client
mirrors it over gloo with the same routes and layout. TRL's own client on GPU needs the
engine to speak vLLM's StatelessProcessGroup/PyNccl rendezvous, which torch's NCCL process
groups (hotswap's nccl backend) do not: its /init_communicator/ is accepted, its group
would not form.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from typing import Any

import torch
from fastapi import Request

from hotswap.engine import verbs
from hotswap.engine.async_llm import AsyncLLM
from hotswap.engine.errors import EngineDeadError, EngineStateError
from hotswap.entrypoints.server.errors import APIError, bad_request
from hotswap.entrypoints.server.group_join import GroupJoin
from hotswap.entrypoints.server.limits import off_loop
from hotswap.entrypoints.server.sessions import PendingWork, TRLSession, dialect_sessions
from hotswap.entrypoints.server.state import get_engine, get_server_config
from hotswap.entrypoints.server.verb_routes import Done, VerbRoute, call_verb
from hotswap.weight_transfer.base import ParamMeta, metas_to_update_info

logger = logging.getLogger(__name__)

# How long /init_communicator/ waits for the engine to refuse the group at once (a port in
# use, an address not allowed) before answering; after that it waits for the trainer.
QUICK_REFUSAL_S = 0.3
WILDCARD_HOSTS = ("0.0.0.0", "::", "")

# init_info's fields in TRL's wire names (for refusals of them).
INIT = VerbRoute(
    "/init_communicator/",
    verbs.InitWeightTransfer,
    sources={"init_info.master_address": "host", "init_info.master_port": "port",
             "init_info.world_size": "world_size"},
)  # fmt: skip
JOIN = GroupJoin("TRL", INIT, "trl")
UPDATE = VerbRoute("/update_named_param/", verbs.UpdateWeights)


# -- the session (server/sessions.py: TRLSession) -----------------------------------------
def trl_session(request: Request) -> TRLSession:
    return dialect_sessions(request).trl


def _run_behind_answer(
    session: TRLSession, task: asyncio.Task[Any], what: str, *, is_init: bool
) -> None:
    """`task` becomes the session's pending work, settled by the next call; its failure
    is logged when it happens (and answered then)."""

    def log_failure(task: asyncio.Task[Any]) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.warning("TRL %s failed after it was answered: %s", what, task.exception())

    task.add_done_callback(log_failure)
    session.pending = PendingWork(task, what, is_init=is_init)


async def settle(session: TRLSession) -> APIError | None:
    """Wait for the work behind the last answer; its failure, as the error to answer now."""
    pending, session.pending = session.pending, None
    if pending is None:
        return None
    try:
        await pending.task
    except Exception as e:  # noqa: BLE001 - reported to the next call
        refused = isinstance(e, APIError) and e.status == 400 and not pending.is_init
        if not refused:  # the channel is gone (a refused parameter leaves it in step)
            session.fail()
        return _deferred(pending.what, e)
    return None


async def raise_deferred_failure(session: TRLSession) -> None:
    """Settle the work behind the last answer; its failure is this call's answer."""
    failure = await settle(session)
    if failure is not None:
        raise failure


def _deferred(what: str, error: Exception) -> APIError:
    """A failure behind an earlier answer, as this call's error: 400 or 409 (TRL's client
    retries 500/502/503, and a retry would pass: the failure is reported once), 503 only
    for a dead engine (that stays dead)."""
    prefix = f"{what} failed after it was answered"
    if isinstance(error, APIError):
        status = error.status if error.status in (400, 409) else 409
        return APIError(status, f"{prefix}: {error.message}")
    if isinstance(error, EngineDeadError):
        return APIError(503, f"{prefix}: engine is not available: {error}")
    return APIError(409, f"{prefix}: {type(error).__name__}: {error}")


async def cancel_init(session: TRLSession, engine: AsyncLLM) -> None:
    """An init still waiting for its trainer is cancelled (the abort answers it at once)."""
    pending = session.pending
    if pending is not None and pending.is_init and not pending.task.done():
        with contextlib.suppress(Exception):
            await engine.finish_weight_update(abort=True)


async def leave_group(engine: AsyncLLM) -> None:
    """Drop the engine's broadcast group (refused mid-round: another client's round is
    left alone)."""
    with contextlib.suppress(EngineStateError):
        await engine.leave_weight_transfer()


# -- the communicator -----------------------------------------------------------------------
def check_transfer_config(request: Request) -> None:
    config = get_engine(request).config.weight_transfer
    if config is None:
        raise APIError(
            409,
            "weight transfer is not configured: start the server with "
            '--weight-transfer-config \'{"backend": "gloo"}\' (or nccl)',
        )
    JOIN.check(request)
    if config.require_complete:
        raise APIError(
            409,
            "TRL sends one parameter per call, each its own round: the server's "
            "require_complete refuses such rounds",
        )


async def drop_communicator(session: TRLSession, engine: AsyncLLM) -> None:
    """Before a new communicator: the old one's pending work settled (its failure only
    logged: the new one replaces it) and its group left (a trainer that died never closed
    it: its port is freed)."""
    await cancel_init(session, engine)
    earlier = await settle(session)
    if earlier is not None:
        logger.warning("TRL /init_communicator/ replaces a failed one: %s", earlier.message)
    if session.is_joined:
        await leave_group(engine)
    session.close()


async def check_world_size(engine: AsyncLLM, world_size: int) -> None:
    workers = await engine.get_world_size()
    if world_size != workers + 1:
        raise bad_request(f"world_size: must be {workers + 1} (this server's {workers} "
                          f"worker(s) and the trainer), got {world_size}",
                          "body.world_size")  # fmt: skip


def group_init_info(request: Request, host: str, port: int, world_size: int) -> dict[str, Any]:
    """The engine's init_info for TRL's layout: the engine's workers from rank 0, the
    trainer last."""
    return {
        "master_address": _store_address(host, request),
        "master_port": port,
        "world_size": world_size,
        "rank_offset": 0,
        "trainer_rank": world_size - 1,
    }


def _store_address(host: str, request: Request) -> str:
    """Where the engine's rank 0 hosts the store. TRL sends "0.0.0.0" (every interface)
    and connects to the address it reached this server on: listen on that one only."""
    if host not in WILDCARD_HOSTS:
        return host
    server = request.scope.get("server")
    return server[0] if server else get_server_config(request).host


async def start_init(request: Request, session: TRLSession, init_info: dict[str, Any]) -> None:
    """Start joining the group: a refusal within QUICK_REFUSAL_S is this call's 400 (in
    TRL's field names); past that the join waits for the trainer behind the answer, as
    TRL joins only once answered."""

    async def answer_first(init: Coroutine[Any, Any, Done]) -> None:
        task = asyncio.create_task(init)
        done, _ = await asyncio.wait({task}, timeout=QUICK_REFUSAL_S)
        if done:
            task.result()  # its refusal is this call's
        else:
            _run_behind_answer(session, task, "init_communicator", is_init=True)

    await JOIN.join(request, init_info, run=answer_first)


# -- one parameter, one round ---------------------------------------------------------------
async def start_param_round(request: Request, session: TRLSession, meta: ParamMeta) -> None:
    """Open the round before the answer; its receive and commit run behind it (the
    trainer broadcasts once answered)."""
    await call_verb(request, UPDATE, verbs.StartWeightUpdate, is_checkpoint_format=True)
    what = f"update_named_param {meta.name!r}"
    task = asyncio.create_task(_receive_and_commit(request, metas_to_update_info([meta])))
    _run_behind_answer(session, task, what, is_init=False)
    await asyncio.sleep(0)  # the receive is submitted (behind the start) before we answer


async def _receive_and_commit(request: Request, update_info: dict[str, Any]) -> Any:
    """The rest of a one-tensor round (as `weight_round`, whose start ran before the
    answer): receive, commit; any failure aborts the round (the old weights keep
    serving)."""
    try:
        await call_verb(request, UPDATE, verbs.UpdateWeights, update_info=update_info)
        return await call_verb(request, UPDATE, verbs.FinishWeightUpdate)
    except BaseException:
        with contextlib.suppress(Exception):
            await get_engine(request).finish_weight_update(abort=True)
        raise


async def check_against_model(session: TRLSession, engine: AsyncLLM, meta: ParamMeta) -> None:
    """What the engine's round would refuse (an unknown name, a shape or dtype kind that
    does not fit), refused before the trainer sends: the engine checks again on receipt."""
    if session.model is None:
        try:
            session.model = await off_loop(_meta_model, engine)
        except Exception as e:  # noqa: BLE001 - the engine still checks every tensor
            logger.warning("TRL: no parameter table for early checks (%s)", e)
            return
    try:
        target = session.model.checkpoint_view(meta.name)
    except ValueError as e:
        raise bad_request(f"name: {e}", "body.name") from None
    if target is None:
        return  # a name the model ignores (e.g. rotary inv_freq)
    dest = target[1]
    if tuple(dest.shape) != meta.shape:
        raise bad_request(f"shape: {list(meta.shape)} does not fit {meta.name!r}: the model "
                          f"expects {list(dest.shape)}", "body.shape")  # fmt: skip
    if dest.is_floating_point() != meta.dtype.is_floating_point:
        raise bad_request(f"dtype: {meta.dtype} does not fit {meta.name!r} ({dest.dtype})",
                          "body.dtype")  # fmt: skip


def _meta_model(engine: AsyncLLM) -> torch.nn.Module:
    """The served model's class on the meta device: its names and shapes, no memory."""
    from hotswap.model.models.registry import get_model_class

    config = engine.config.model
    with torch.device("meta"):
        return get_model_class(config.architecture)(
            config.hf_config, config.dtype, None, False, config.head_dtype
        )
