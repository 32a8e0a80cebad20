"""The init and update infos of the weight-transfer backends, declared as msgspec structs
(vLLM's `init_info_cls` / `update_info_cls`), and their one parser (`parse_info`).

Each backend names its two structs (`WeightTransferEngine.init_info_cls`, `update_info_cls`);
the engine parses what it receives with them, and a front end that knows the configured
backend validates with the same structs before sending (`verbs.make_args(backend=...)`;
an update's only where the engine need not see a refused chunk: verb_routes.info_backend).
A refusal names the field by its path from the argument (`init_info.master_port`,
`update_info.shapes[2]`), so no caller reads message text to find it.

Unknown keys are ignored (dropped from the struct, kept in the dict that travels): RL
clients send fields a backend does not read, and a backend outside this package (ray's)
reads keys of its own. A leaf beside `config.py`: msgspec and the dtype names (dtypes.py).
"""

from __future__ import annotations

import typing
from typing import Annotated, Any, ClassVar, Literal

import msgspec

from hotswap.errors import InvalidArgument
from hotswap.msgspec_errors import MISSING, SEGMENT, WORDS, shown, split_error, unwrapped
from hotswap.weight_transfer.dtypes import DTYPE_NAMES

DEFAULT_BUFFER_BYTES = 64 << 20
DEFAULT_NUM_BUFFERS = 2
DEFAULT_TIMEOUT_S = 120.0
# Upper bounds on what a control caller may ask for: a receive blocks the weight plane up
# to `timeout_s` (a pending gloo wait cannot be interrupted), and buffers are allocated.
MAX_TIMEOUT_S = 600.0
MAX_PORT = 65535
MAX_WORLD_SIZE = 1 << 16
MAX_BUFFER_BYTES = 1 << 36
MAX_NUM_BUFFERS = 64
MAX_GROUP_NAME_CHARS = 256
MAX_PATH_CHARS = 4096  # PATH_MAX

# A dtype a tensor can be sent in (dtypes.py), also as torch spells it ("torch.bfloat16":
# PipelineRL's str(dtype)).
DTypeName = Annotated[
    Literal[DTYPE_NAMES + tuple(f"torch.{name}" for name in DTYPE_NAMES)],  # type: ignore[valid-type]
    msgspec.Meta(
        description=f"one of {', '.join(DTYPE_NAMES)}", extra={"refused": "unknown dtype"}
    ),
]
TensorName = Annotated[str, msgspec.Meta(min_length=1, description="a non-empty string")]
Size = Annotated[int, msgspec.Meta(ge=0)]  # no description: a refused size names its shape
Count = Annotated[int, msgspec.Meta(ge=0, description="a non-negative integer")]
Shape = Annotated[list[Size], msgspec.Meta(description="a list of sizes")]


def _int(low: int, high: int) -> Any:
    return Annotated[int, msgspec.Meta(ge=low, le=high,
                                       description=f"an integer in [{low}, {high}]")]  # fmt: skip


Port = _int(1, MAX_PORT)
WorldSize = _int(2, MAX_WORLD_SIZE)
Rank = _int(0, MAX_WORLD_SIZE)
BufferBytes = _int(1, MAX_BUFFER_BYTES)
NumBuffers = _int(1, MAX_NUM_BUFFERS)


class Info(msgspec.Struct, kw_only=True, frozen=True):
    """Base of the infos. `check` refuses what one field's type cannot say (fields that
    must agree), naming fields relative to the info."""

    def check(self) -> None:
        """InvalidArgument naming the field (relative to the info) at fault."""


# -- init infos -----------------------------------------------------------------------------
class NoInitInfo(Info):
    """A backend with nothing to set up (ipc, disk, inline): any object is accepted."""


class BroadcastInitInfo(Info):
    """gloo / nccl / sparse: the group to join (broadcast.py's BroadcastEngine says how)."""

    master_address: Annotated[
        str, msgspec.Meta(min_length=1, max_length=255, description="a host name or address")
    ]
    master_port: Port
    world_size: WorldSize
    trainer_rank: Rank = 0
    rank_offset: Rank | None = None  # None: the first rank not the trainer's
    group_name: Annotated[
        str,
        msgspec.Meta(min_length=1, max_length=MAX_GROUP_NAME_CHARS,
                     description=f"a string of 1 to {MAX_GROUP_NAME_CHARS} characters"),
    ] | None = None  # fmt: skip
    packed: bool | None = None  # None: packed unless the group is named
    packed_buffer_size_bytes: BufferBytes = DEFAULT_BUFFER_BYTES
    packed_num_buffers: NumBuffers = DEFAULT_NUM_BUFFERS
    timeout_s: Annotated[
        float,
        msgspec.Meta(gt=0, le=MAX_TIMEOUT_S,
                     description=f"a number of seconds in (0, {MAX_TIMEOUT_S:g}]"),
    ] = DEFAULT_TIMEOUT_S  # fmt: skip

    @property
    def rank(self) -> int:
        """This engine's first worker rank (after the trainer's rank 0, else from 0)."""
        if self.rank_offset is not None:
            return self.rank_offset
        return 1 if self.trainer_rank == 0 else 0

    @property
    def is_packed(self) -> bool:
        return self.group_name is None if self.packed is None else self.packed

    def check(self) -> None:
        if self.trainer_rank >= self.world_size:
            raise InvalidArgument(
                "trainer_rank",
                f"trainer_rank: must be an integer in [0, {self.world_size - 1}], "
                f"got {self.trainer_rank}",
            )
        rank = self.rank
        if self.trainer_rank == 0 and rank < 1:
            raise InvalidArgument("rank_offset", f"rank_offset: must be an integer in "
                                  f"[1, {MAX_WORLD_SIZE}], got {rank}")  # fmt: skip
        if rank >= self.world_size:
            raise InvalidArgument(
                "rank_offset", f"rank_offset: {rank} is outside world_size {self.world_size}"
            )
        if rank == self.trainer_rank:
            raise InvalidArgument(
                "rank_offset", f"rank_offset: {rank} is the trainer's rank (trainer_rank)"
            )
        if self.packed and self.group_name is not None:
            raise InvalidArgument("packed", "packed: a named group carries one broadcast per "
                                  "tensor; packed must be false")  # fmt: skip


# -- update infos ---------------------------------------------------------------------------
class TensorsInfo(Info):
    """The tensors a chunk delivers, in order: three lists of equal length."""

    names: list[TensorName]
    dtype_names: list[DTypeName]
    shapes: list[Shape]

    # The keys of the three lists (a dialect maps them onto its own names).
    LISTS: ClassVar[tuple[str, ...]] = ("names", "dtype_names", "shapes")

    def check(self) -> None:
        counts = {key: len(getattr(self, key)) for key in self.LISTS}
        if len(set(counts.values())) != 1:
            # The whole info: which list is "wrong" is the caller's reading.
            raise InvalidArgument(None, f"names, dtype_names and shapes differ in length {counts}")
        seen: set[str] = set()
        for name in self.names:
            if name in seen:
                raise InvalidArgument("names", f"names: {name!r} appears twice")
            seen.add(name)


class SparseInfo(TensorsInfo):
    """sparse.py: plus the number of changed elements of each tensor."""

    nnz: list[Count] | None = None

    def check(self) -> None:
        super().check()
        if self.nnz is None or len(self.nnz) != len(self.names):
            raise InvalidArgument("nnz", "nnz: required, one count per name")
        for i, (count, shape) in enumerate(zip(self.nnz, self.shapes)):
            numel = 1
            for size in shape:
                numel *= size
            if count > numel:
                raise InvalidArgument(f"nnz[{i}]", f"nnz[{i}]: {count} exceeds {numel} elements")


Placement = Annotated[tuple[Size, Size], msgspec.Meta(description="[segment index, byte offset]")]


SegmentNames = Annotated[list[str], msgspec.Meta(description="a list of segment names")]


class IPCInfo(TensorsInfo):
    """ipc.py: plus where the tensors lie: `segments` (names) and a placement per tensor,
    or `cuda_ipc` (a handle per tensor, checked by cuda_ipc.py when opened)."""

    segments: SegmentNames | None = None
    placements: list[Placement] | None = None
    cuda_ipc: list[Any] | None = None

    def check(self) -> None:
        super().check()
        count = len(self.names)
        if self.cuda_ipc is not None:
            if len(self.cuda_ipc) != count:
                raise InvalidArgument(
                    "cuda_ipc", f"cuda_ipc: required, one handle per name ({count})"
                )
            return
        if self.segments is None:
            raise InvalidArgument("segments", "segments: required, a list of segment names")
        if self.placements is None or len(self.placements) != count:
            raise InvalidArgument("placements", f"placements: required, one [segment, byte "
                                  f"offset] per name ({count})")  # fmt: skip
        for i, (index, _) in enumerate(self.placements):
            if index >= len(self.segments):
                listed = len(self.segments)
                raise InvalidArgument(f"placements[{i}]", f"placements[{i}]: segment index "
                                      f"{index}, but {listed} segment(s) listed")  # fmt: skip


class DiskInfo(Info):
    """disk.py: the checkpoint directory (then confined, checked and read by the engine)."""

    model_path: Annotated[
        str,
        msgspec.Meta(min_length=1, max_length=MAX_PATH_CHARS,
                     description=f"a directory path of at most {MAX_PATH_CHARS} characters"),
    ]  # fmt: skip


# -- parsing --------------------------------------------------------------------------------
InfoT = typing.TypeVar("InfoT", bound=Info)


def parse_info(cls: type[InfoT], value: object, field: str) -> InfoT:
    """`value` (a JSON object) as `cls`, checked; InvalidArgument naming the path from
    `field` (`init_info.master_port`, `update_info.shapes[2]`)."""
    try:
        info = msgspec.convert(value, cls, strict=True)  # strict: "1" is not a port
    except msgspec.ValidationError as e:
        raise _refusal(cls, value, field, str(e)) from None
    try:
        info.check()
    except InvalidArgument as e:  # named relative to the info: name it from `field`
        message = str(e).removeprefix(f"{e.field}: ") if e.field else str(e)
        raise _refused(field, f".{e.field}" if e.field else "", message) from None
    return info


def _refusal(cls: type[Info], value: object, field: str, error: str) -> InvalidArgument:
    what, path = split_error(error) or (error, "")
    missing = MISSING.match(what)
    if missing is not None:
        return _refused(field, f"{path}.{missing.group(1)}", "required")
    if not path:  # the info itself: not an object
        return InvalidArgument(field or None, f"{field or 'body'}: must be a JSON object")
    segments, (described, refused), sent = _entry(cls, value, SEGMENT.findall(path))
    where = "".join(segments)
    if described is None:
        return _refused(field, where, what)
    if refused:
        return _refused(field, where, f"{refused} {shown(sent)}; must be {described}")
    return _refused(field, where, f"must be {described}, got {shown(sent)} ({what})")


def _refused(field: str, path: str, why: str) -> InvalidArgument:
    """Refused at `path` inside `field` (the info's argument; "" when it is the body)."""
    where = f"{field}{path}" if field else path.removeprefix(".")
    return InvalidArgument(where or None, f"{where or 'body'}: {why}")


def _entry(
    cls: type[Info], value: object, segments: list[str]
) -> tuple[list[str], tuple[str | None, str | None], object]:
    """The refused entry a caller sent, named down to the deepest field, struct or
    described value on the path (`shapes[2]`, not `shapes[2][0]`: a shape is refused, not a
    size); what its declaration says (a description, and what a refused value is called);
    and the value sent there."""
    field_type: Any = cls
    kept: tuple[int, tuple[str | None, str | None], object] = (0, (None, None), value)
    for i, segment in enumerate(segments):
        field_type = unwrapped(field_type)
        if segment.startswith("."):
            field_type = {f.name: f.type for f in msgspec.structs.fields(field_type)}[segment[1:]]
            value = value.get(segment[1:]) if isinstance(value, dict) else None
        else:
            field_type = typing.get_args(field_type)[0]
            index = int(segment[1:-1])
            value = value[index] if isinstance(value, list) and index < len(value) else None
        declared, plain = _description(field_type), unwrapped(field_type)
        is_struct = isinstance(plain, type) and issubclass(plain, msgspec.Struct)
        if segment.startswith(".") or is_struct or declared[0] is not None:
            kept = (i + 1, declared, value)
        if kept[0] == i + 1 and declared[0] is None and plain in WORDS:
            kept = (i + 1, (WORDS[plain], None), value)
    return segments[: kept[0]], kept[1], kept[2]


def _description(field_type: Any) -> tuple[str | None, str | None]:
    """A declared description, and what a refused value is called (Meta `extra`)."""
    for part in (field_type, *typing.get_args(field_type)):
        if typing.get_origin(part) is Annotated:
            metas = [m for m in typing.get_args(part)[1:] if isinstance(m, msgspec.Meta)]
            if metas and metas[0].description:
                return metas[0].description, (metas[0].extra or {}).get("refused")
    return None, None
