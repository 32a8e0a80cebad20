"""Encoding of engine-core messages for the process transport (msgpack via msgspec).

Input frames are [kind, payload]; output frames are one `EngineCoreOutputs`. Pickle never
crosses the socket.
"""

from __future__ import annotations

from typing import Any

import msgspec

from hotswap.engine.core_loop import InputKind
from hotswap.engine.messages import EngineCoreOutputs, EngineCoreRequest, UtilityCall

READY = b"READY"

_encoder = msgspec.msgpack.Encoder()
_payload_decoders = {
    InputKind.ADD: msgspec.msgpack.Decoder(EngineCoreRequest),
    InputKind.ABORT: msgspec.msgpack.Decoder(list[str]),
    InputKind.STOP: msgspec.msgpack.Decoder(list[str]),
    InputKind.UTILITY: msgspec.msgpack.Decoder(UtilityCall),
    InputKind.SHUTDOWN: msgspec.msgpack.Decoder(None),
}
_outputs_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)


def encode_input(kind: InputKind, payload: Any) -> list[bytes]:
    return [bytes([kind]), _encoder.encode(payload)]


def decode_input(frames: list[bytes]) -> tuple[InputKind, Any]:
    kind = InputKind(frames[0][0])
    return kind, _payload_decoders[kind].decode(frames[1])


def encode_outputs(batch: EngineCoreOutputs) -> bytes:
    return _encoder.encode(batch)


def decode_outputs(data: bytes) -> EngineCoreOutputs:
    return _outputs_decoder.decode(data)
