"""Tensors sent by value in the call itself (the `load_weights_inline` verb; SGLang's
`/update_weights_from_tensor` in its JSON-safe form): raw bytes of a declared dtype and
shape, never anything to unpickle.

`InlineEngine` is the in-memory `WeightTransferEngine` the engine uses for one such round,
as it uses a `DiskEngine` for a disk reload: the same validation, staging and all-or-nothing
commit as any round. It has no channel, so it is no backend a weight transfer config can
name (not registered). `inline_tensors` builds what it takes from torch tensors.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Protocol

import torch

from hotswap.errors import InvalidArgument
from hotswap.weight_transfer.base import ParamMeta
from hotswap.weight_transfer.dtypes import dtype_name, parse_dtype_name
from hotswap.weight_transfer.engine import WeightTransferEngine

ARGUMENT = "tensors"  # the verb's argument that refusals name (`tensors[3].data`)


class Sent(Protocol):
    """One tensor by value (verbs.InlineTensor): C-order, little-endian bytes."""

    name: str
    dtype: str
    shape: Sequence[int]
    data: bytes


def inline_tensors(
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
) -> list[dict[str, Any]]:
    """Named torch tensors as `load_weights_inline` takes them: {name, dtype, shape, data}
    with `data` their raw bytes (base64-encode it for JSON)."""
    if sys.byteorder == "big":
        raise NotImplementedError("inline tensors are little-endian; this host is not")
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    sent = []
    for name, tensor in items:
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
        sent.append(
            {
                "name": name,
                "dtype": dtype_name(tensor.dtype),
                "shape": list(tensor.shape),
                "data": data,
            }  # fmt: skip
        )
    return sent


class InlineEngine(WeightTransferEngine):
    """The round's tensors come in `update_info["tensors"]` (a list of `Sent`); receiving
    them copies their bytes into the engine's buffers."""

    backend: ClassVar[str] = "inline"
    needs_init: ClassVar[bool] = False

    def init_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Nothing to set up."""

    def parse_update_info(self, update_info: dict[str, Any]) -> list[ParamMeta]:
        """A meta per tensor, each checked: a known dtype, a shape of sizes, exactly
        numel x itemsize bytes, a name not sent twice. Refusals name `tensors[i].field`."""
        tensors = update_info.get(ARGUMENT) if isinstance(update_info, dict) else None
        if not isinstance(tensors, list) or not tensors:
            raise InvalidArgument(ARGUMENT, f"{ARGUMENT}: must be a non-empty list of tensors")
        metas, seen = [], {}
        for i, sent in enumerate(tensors):
            at = f"{ARGUMENT}[{i}]"
            name, shape, data = sent.name, sent.shape, sent.data
            if not isinstance(name, str) or not name:
                raise InvalidArgument(f"{at}.name", f"{at}.name: must be a non-empty string")
            if name in seen:
                raise InvalidArgument(
                    f"{at}.name",
                    f"{at}.name: {name!r} appears twice (first at index {seen[name]})",
                )
            seen[name] = i
            dtype = parse_dtype_name(sent.dtype, f"{at}.dtype")
            if not isinstance(shape, (list, tuple)) or not all(_is_size(s) for s in shape):
                raise InvalidArgument(f"{at}.shape", f"{at}.shape: must be a list of sizes")
            meta = ParamMeta(name, dtype, tuple(shape))
            if not isinstance(data, (bytes, bytearray, memoryview)) or len(data) != meta.nbytes:
                got = len(data) if isinstance(data, (bytes, bytearray, memoryview)) else "no"
                raise InvalidArgument(
                    f"{at}.data",
                    f"{at}.data: {got} bytes, but a {dtype_name(dtype)} tensor of shape "
                    f"{list(shape)} is {meta.nbytes} bytes ({meta.numel} x {dtype.itemsize})",
                )
            if dtype == torch.bool and bytes(data).translate(None, b"\x00\x01"):
                raise InvalidArgument(f"{at}.data", f"{at}.data: a bool tensor's bytes are 0 or 1")
            metas.append(meta)
        return metas

    def receive_weights(
        self, update_info: dict[str, Any], metas: list[ParamMeta]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        if sys.byteorder == "big":
            raise NotImplementedError("inline tensors are little-endian; this host is not")
        for meta, sent in zip(metas, update_info[ARGUMENT]):
            buffer = self.allocate(meta)
            if meta.numel:
                with warnings.catch_warnings():  # read-only bytes: copied out at once
                    warnings.filterwarnings("ignore", "The given buffer is not writable")
                    raw = torch.frombuffer(sent.data, dtype=torch.uint8)
                buffer.copy_(raw.view(meta.dtype).reshape(meta.shape))
            yield meta.name, buffer


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0
