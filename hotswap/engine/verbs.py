"""The control verbs: every call a front-end can make to an engine core, declared once.

A verb is one class: its arguments (a msgspec struct whose tag is the verb's name, with the
constraints the arguments must meet), and, as class attributes, how data-parallel ranks'
answers merge and how it runs beside a weight transfer. Everything else is generic over
this table (`VERBS`, read from the classes): the engine core's managers handle a verb by
its class (`@handles(FinishWeightUpdate)`, hotswap/engine/handlers.py), the engine-core
loop dispatches by the arguments' class, `AsyncLLM`, `LLM` and the Ray engine actor have a
method per verb made from it (verb_methods.py), the DP client merges by it, and the HTTP
dialects map their routes onto it. Adding a verb is: its class here, its handler, its
route. Only declared verbs can be invoked: the wire decoder knows no other tag.

Arguments are validated once, where they enter (`make_args`), and a refusal names its
field (`InvalidArgument.field`), so an HTTP 400 says which field without parsing text.
"""

from __future__ import annotations

import enum
import functools
import typing
from typing import Annotated, Any, ClassVar, Literal

import msgspec

from hotswap.errors import InvalidArgument
from hotswap.msgspec_errors import describe, nested_refusal, shown
from hotswap.weight_transfer.dtypes import DTYPE_NAMES

PauseMode = Literal["abort", "wait", "keep"]
SleepTag = Literal["weights", "kv_cache", "scheduling"]
PAUSE_MODES: tuple[str, ...] = typing.get_args(PauseMode)
SLEEP_TAGS: tuple[str, ...] = typing.get_args(SleepTag)

MAX_LABEL_CHARS = 256  # a weight-version label: a name, not a payload
MAX_PATH_CHARS = 4096  # PATH_MAX
Label = Annotated[
    str, msgspec.Meta(min_length=1, max_length=MAX_LABEL_CHARS, description="a non-empty string")
]
Path = Annotated[
    str,
    msgspec.Meta(min_length=1, max_length=MAX_PATH_CHARS, description="a path to a directory"),
]
JSONObject = Annotated[dict[str, Any], msgspec.Meta(description="a JSON object")]
InitInfo = Annotated[JSONObject, "init_info_cls"]  # typed by the backend's struct: see
UpdateInfo = Annotated[JSONObject, "update_info_cls"]  # infos.py, make_args(backend=)
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256, description="a name")]
# The dtypes a tensor can be sent in by value: those a round may carry (dtypes.py).
TensorDType = Literal[DTYPE_NAMES]  # type: ignore[valid-type]
MAX_TENSOR_DIMS = 16
TensorName = Annotated[
    str, msgspec.Meta(min_length=1, max_length=1024, description="a tensor's name")
]
Shape = Annotated[
    list[Annotated[int, msgspec.Meta(ge=0)]],
    msgspec.Meta(max_length=MAX_TENSOR_DIMS, description="a list of sizes"),
]


class Merge(enum.Enum):
    """How the answers of data-parallel ranks become one."""

    FIRST = "first"  # every rank did the same thing: rank 0's answer
    SUM = "sum"  # counts
    ANY = "any"  # flags: true if true on any rank
    STATS = "stats"  # numbers summed, maxed or averaged per key
    DIGEST = "digest"  # rank 0's, but a digest the ranks disagree on is reported as such
    UNION = "union"  # dicts keyed by rank already (per-tensor checksums): their union
    PER_RANK = "per_rank"  # each rank answers a list: their concatenation (collective_rpc)


class Args(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True, tag=True):
    """Base of every verb's arguments; the tag (the class's verb name) names the verb. A
    verb overrides the class attributes below where it differs (they are not arguments)."""

    # How the answers of data-parallel ranks become one (dp_client.py).
    merge: ClassVar[Merge] = Merge.FIRST
    # Uses the weights or the transfer channel: waits (in arrival order) while a call runs
    # on the worker thread, and is refused while an init waits for its trainer.
    behind_channel: ClassVar[bool] = False
    # Blocks on the trainer, not on the engine: runs on the worker thread.
    on_worker: ClassVar[bool] = False
    # The name of the clients' method (verb_methods.py) where it is not the verb's own.
    client_name: ClassVar[str | None] = None


# -- scheduling ------------------------------------------------------------------------------
class Pause(Args, tag="pause"):
    """Pause as docs/design.md §3: returns once the mode's condition holds and every output
    produced before it has reached its stream. Invalid mode: refused, no change."""

    client_name = "pause_generation"

    mode: PauseMode = "abort"
    clear_cache: bool = True


class Resume(Args, tag="resume"):
    client_name = "resume_generation"


class IsPaused(Args, tag="is_paused"):
    merge = Merge.ANY


class ResetPrefixCache(Args, tag="reset_prefix_cache"):
    """Forget cached prefixes (returns how many blocks were cached); with
    `reset_running_requests` running requests recompute their KV too."""

    merge = Merge.SUM

    reset_running_requests: bool = False


class GetStats(Args, tag="get_stats"):
    """Queue sizes, KV usage, pause state and weight version of the engine core."""

    merge = Merge.STATS


# -- sleep -----------------------------------------------------------------------------------
class Sleep(Args, tag="sleep"):
    """Pause with `mode`, then level 0 stops scheduling, 1 also frees the KV cache and
    offloads the weights, 2 discards the weights (send or load them after waking)."""

    behind_channel = True

    level: Literal[0, 1, 2] = 1
    mode: PauseMode = "abort"


class WakeUp(Args, tag="wake_up"):
    """Wake `tags` (weights, kv_cache, scheduling; None = all that sleep). Returns
    {is_sleeping, tags_woken}."""

    behind_channel = True

    tags: list[SleepTag] | None = None


class IsSleeping(Args, tag="is_sleeping"):
    merge = Merge.ANY


# -- weights ---------------------------------------------------------------------------------
class LoadWeightsFromDisk(Args, tag="load_weights_from_disk"):
    """Reload all weights from a safetensors directory between two steps (all or
    nothing) and commit a new version; returns {version, label}."""

    behind_channel = True

    model_path: Path
    weight_version: Label | None = None  # the new version's label (default: model_path)


class InlineTensor(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """One tensor sent by value: its raw bytes, little-endian, in C order. From JSON,
    `data` is their base64 (standard alphabet, padded), decoded where the call enters:
    the engine core receives the bytes themselves (msgpack's bin). Bytes never become
    objects other than a tensor of `dtype` and `shape` (nothing is unpickled)."""

    name: TensorName  # the checkpoint (state-dict) name
    dtype: TensorDType
    shape: Shape
    # numel x itemsize bytes, checked by the engine (weight_transfer/inline.py)
    data: Annotated[bytes, msgspec.Meta(description="the tensor's raw bytes (in JSON: base64)")]


class LoadWeightsInline(Args, tag="load_weights_inline"):
    """Load the tensors sent (a partial update: only those named change; all of them with
    the weight transfer config's `require_complete`) in one validated, all-or-nothing round,
    as a disk reload does, and commit a new version. Their size is the caller's to bound:
    over HTTP, the request body limit (--max-request-body-bytes) does."""

    behind_channel = True

    tensors: Annotated[
        list[InlineTensor], msgspec.Meta(min_length=1, description="a non-empty list of tensors")
    ]
    weight_version: Label | None = None  # the new version's label (default: the current)


class InitWeightTransfer(Args, tag="init_weight_transfer_engine"):
    """Join the trainer's channel (the configured backend's `init_info`); may block
    until the trainer joins too."""

    behind_channel = on_worker = True

    init_info: InitInfo  # the backend's init info (as sent: unknown keys travel on)


class LeaveWeightTransfer(Args, tag="leave_weight_transfer"):
    """Leave the trainer's channel between rounds (SGLang's destroy, TRL's close)."""

    merge, behind_channel = Merge.ANY, True


class StartWeightUpdate(Args, tag="start_weight_update"):
    """Open a round: no model step runs until it is finished or aborted (unless
    the transfer config receives in flight). With `lora_name`, the round sends that LoRA
    adapter's PEFT tensors instead (only those sent change; steps go on meanwhile) and
    its commit is the adapter's next version; `lora_config` (adapter_config.json's r,
    lora_alpha, target_modules...) declares a new adapter, which the round sends whole."""

    behind_channel = True

    is_checkpoint_format: bool = True
    lora_name: Name | None = None
    lora_config: JSONObject | None = None


class UpdateWeights(Args, tag="update_weights"):
    """Receive one chunk (validated, staged; the model is not touched yet)."""

    behind_channel = on_worker = True

    update_info: UpdateInfo  # the backend's update info (as sent: unknown keys travel on)


class PrepareWeightUpdate(Args, tag="prepare_weight_update"):
    """Phase one of a commit across engines: refuse now what `finish` would refuse
    (e.g. an incomplete round under `require_complete`), apply nothing; the round stays
    open. Returns the number of staged tensors."""

    behind_channel = True


class FinishWeightUpdate(Args, tag="finish_weight_update"):
    """Apply the staged weights all at once and commit version + 1 labelled
    `weight_version`; `abort=True` drops the round instead. Returns {version, label,
    digest} as of this commit: `digest` (a blake2b of the weights, as `get_weight_info`
    gives) only when asked for, since it reads every weight, otherwise None; with
    `checksum`, also `checksums` (one SHA-256 per tensor, vLLM's)."""

    merge, behind_channel = Merge.DIGEST, True

    weight_version: Label | None = None  # the new version's label (default: the current)
    abort: bool = False
    digest: bool = False  # hotswap: a blake2b of every weight, as get_weight_info gives
    checksum: bool = False  # vLLM: one SHA-256 per tensor, keyed by rank and name
    # Requests running across the switch: continue on their KV (later tokens are stale)
    # or recompute it under the new weights before their next token (None: the weight
    # transfer config's kv_policy, "keep" by default).
    kv_policy: Literal["keep", "recompute"] | None = None


class GetWorldSize(Args, tag="get_world_size"):
    """Receiving workers behind this engine (a broadcast group is this + 1)."""

    merge, behind_channel = Merge.SUM, True


class GetWeightInfo(Args, tag="get_weight_info"):
    """{version, label, digest} of the loaded weights."""

    merge = Merge.DIGEST


class UpdateWeightVersion(Args, tag="update_weight_version"):
    """Commit a new weight version (+1) labelled `label`; returns {version, label}."""

    label: Label


class GetWeightVersion(Args, tag="get_weight_version"):
    pass


class UpdateWeightLabel(Args, tag="update_weight_label"):
    """Rename the current weights without committing a new version (vLLM's RFC route)."""

    label: Label


class WeightUpdateActive(Args, tag="weight_update_active"):
    merge = Merge.ANY


class GetWeightChecksums(Args, tag="get_weight_checksums"):
    """vLLM's per-tensor SHA-256 checksums of the loaded weights (its weight checker)."""

    merge = Merge.UNION


# -- LoRA adapters -------------------------------------------------------------------------
class LoadLoraAdapter(Args, tag="load_lora_adapter"):
    """Load the PEFT adapter in `lora_path` (adapter_config.json and
    adapter_model.safetensors, inside the allowed weight directories) under `lora_name`;
    `load_inplace` replaces one already loaded under that name (requests running on it
    finish on the version they started with). Returns {lora_name, lora_path, version,
    rank}."""

    lora_name: Name
    lora_path: Path
    load_inplace: bool = False
    # hotswap: check everything and hold the adapter aside until commit_lora_adapter, so
    # that DP ranks switch together (one rank's refusal aborts the load everywhere)
    prepare: bool = False


class CommitLoraAdapter(Args, tag="commit_lora_adapter"):
    """Serve the adapter a `load_lora_adapter(prepare=True)` held aside (or drop it,
    `abort`); returns its description (None when aborted)."""

    lora_name: Name
    abort: bool = False


class UnloadLoraAdapter(Args, tag="unload_lora_adapter"):
    """Forget the adapter named `lora_name` (requests running on it finish first)."""

    lora_name: Name


class ListLoraAdapters(Args, tag="list_lora_adapters"):
    """The loaded adapters: [{lora_name, lora_path, version, rank}]."""


# -- the worker extension --------------------------------------------------------------------
class CollectiveRpc(Args, tag="collective_rpc"):
    """Call a public method of the worker extension named at start (worker.py) on every
    engine core; answered with one result per core."""

    # It may touch the weights: it waits behind a transfer, like a round's phases.
    merge, behind_channel = Merge.PER_RANK, True

    method: Name
    args: list[Any] = msgspec.field(default_factory=list)
    kwargs: dict[str, Any] = msgspec.field(default_factory=dict)


def verb_name(args: type[Args] | Args) -> str:
    cls = args if isinstance(args, type) else type(args)
    return cls.__struct_config__.tag  # type: ignore[return-value]


# Every declared verb by name, in declaration order: the classes above.
VERBS: dict[str, type[Args]] = {verb_name(cls): cls for cls in Args.__subclasses__()}

# What a UtilityCall carries: exactly one declared verb's arguments (a tagged union).
AnyArgs = typing.Union[tuple(VERBS.values())]  # noqa: UP007


def verb_class(verb: str | type[Args]) -> type[Args]:
    """The verb's class, given it or its name (a caller's string: InvalidArgument on
    `method` if no verb has that name)."""
    if isinstance(verb, type):
        return verb
    declared = VERBS.get(verb)
    if declared is None:
        raise InvalidArgument("method", f"method: {verb!r} is not a control verb")
    return declared


def make_args(
    verb: str | type[Args],
    values: dict[str, Any],
    *,
    lax: bool = False,
    backend: str | None = None,
) -> Args:
    """The verb's (its class, or its name) arguments from `values`, each checked against
    its declared type and constraints (a transfer info: as `backend`'s, if given);
    InvalidArgument names the first field refused. `lax` accepts the string forms a query
    string carries ("false", "1")."""
    declared = verb_class(verb)
    fields = argument_fields(declared)
    for name in values:
        if name not in fields:
            raise InvalidArgument(name, f"{name}: {verb_name(declared)} takes no such argument")
    checked = {}
    for name, value in values.items():
        checked[name] = _convert(name, value, fields[name].type, lax)
        if backend is not None:  # a transfer info: checked with the backend's struct
            from hotswap.weight_transfer.backends import check_info  # torch: only if asked

            check_info(backend, fields[name].type, checked[name], name)
    missing = [f.name for f in fields.values() if f.required and f.name not in checked]
    if missing:
        raise InvalidArgument(missing[0], f"{missing[0]}: required")
    return declared(**checked)


@functools.cache
def argument_fields(verb: str | type[Args]) -> dict[str, msgspec.structs.FieldInfo]:
    """The verb's (its class, or a declared verb's name) arguments by name."""
    return {f.name: f for f in msgspec.structs.fields(verb_class(verb))}


def _convert(name: str, value: Any, field_type: Any, lax: bool) -> Any:
    try:
        return msgspec.convert(value, field_type, strict=not lax)
    except msgspec.ValidationError as e:
        nested = nested_refusal(name, field_type, str(e))
        if nested is not None:
            raise nested from None
        raise InvalidArgument(name, f"{name}: must be {describe(field_type)}, got "
                              f"{shown(value)} ({e})") from None  # fmt: skip
