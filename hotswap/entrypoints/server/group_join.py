"""One way for the dialects that join a trainer's process group.

SGLang (`/init_weights_update_group`), AReaL (`/areal_init_weights_update_group`), TRL
(`/init_communicator/`) and PipelineRL (`/init_actor_update_group`) each ask the server to
join a torch.distributed group their trainer creates, then broadcast every tensor in it,
one broadcast each in its own dtype. A dialect declares its `GroupJoin` (its framework, its
join route with its field names, its session, the field naming its group's backend) and
builds the engine's `init_info` from its fields; the rest is the same for all four:
- the checks every such group makes of the server (`check`): it receives over a process
  group (gloo or nccl: any other backend would read the trainer's calls as something
  else), and the trainer's group uses the torch backend the engine's uses on its device;
- the engine's init (`join`), unpacked, with refusals in the dialect's field names;
- the session's bookkeeping: once the init is valid, the old group is left (whatever the
  init then does), and the session joins the new one when the engine has joined it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from hotswap.entrypoints.server.errors import APIError, bad_request
from hotswap.entrypoints.server.sessions import GroupSession, dialect_sessions
from hotswap.entrypoints.server.state import get_engine
from hotswap.entrypoints.server.verb_routes import (
    Done,
    VerbRoute,
    call_route,
    info_backend,
    route_args,
)
from hotswap.weight_transfer.backends import get_backend, group_backend

# How a dialect awaits the engine's init (TRL answers before its trainer joins).
Run = Callable[[Coroutine[Any, Any, Done]], Awaitable[Any]]


@dataclass(frozen=True)
class GroupJoin:
    """A dialect's join of its trainer's group (see the module docstring)."""

    framework: str  # named in the 409 when this server cannot meet the group ("SGLang")
    route: VerbRoute  # the join route: its names / sources give init_info's body fields
    session: str  # the dialect's session in DialectSessions ("sglang")
    # The body field naming the torch.distributed backend of the trainer's group (None: the
    # dialect sends none), and the dialect's default when a body leaves it out.
    backend_field: str | None = None
    default_backend: str | None = None

    def session_of(self, request: Request) -> GroupSession:
        return getattr(dialect_sessions(request), self.session)

    def check(self, request: Request, values: Mapping[str, Any] | None = None) -> None:
        """A 409 unless the server receives over a process group; with the body's
        `values`, a 400 naming the backend field unless the trainer's group uses the
        engine's torch backend (mapping one onto the other cannot work: the two groups
        would never meet, their keys and transports differ). Unconfigured: the engine's
        own refusal says how to configure it."""
        engine_config = get_engine(request).config
        config = engine_config.weight_transfer
        if config is None:
            return
        expected = group_backend(engine_config.device)
        if get_backend(config.backend).group_device is None:
            raise APIError(
                409,
                f"{self.framework} broadcasts weights over a process group, but this server "
                f"receives with the {config.backend!r} backend; start it with "
                f'--weight-transfer-config \'{{"backend": "{expected}"}}\'',
            )
        if self.backend_field is None or values is None:
            return
        backend = values.get(self.backend_field, self.default_backend)
        if backend != expected:
            raise bad_request(
                f"{self.backend_field}: this server's engine runs on {engine_config.device} "
                f"and joins weight-update groups with {expected}; create the trainer's group "
                f"with backend={expected!r} (got {backend!r})",
                f"body.{self.backend_field}",
            )

    async def join(
        self,
        request: Request,
        init_info: dict[str, Any],
        values: Mapping[str, Any] | None = None,
        run: Run | None = None,
    ) -> None:
        """The engine joins the group `init_info` describes (in the engine's names, one
        typed broadcast per tensor: unpacked), after `check` (with the body's `values`);
        a refusal names the dialect's field. `run` awaits the init as the dialect does
        (default: until the engine has joined)."""
        self.check(request, values)
        args = route_args(
            self.route,
            {"init_info": {**init_info, "packed": False}},
            info_backend(request, self.route.verb),
        )
        session = self.session_of(request)
        session.close()  # the old group goes whatever happens
        call = call_route(request, self.route, args)
        await (call if run is None else run(call))
        session.join(init_info.get("group_name"))
