"""Host-to-device uploads of a step's small inputs without a host sync: the values are
written into a pinned host buffer and copied with one asynchronous copy; the device keeps
one buffer the step's tensors are views of. On the host itself (the CPU, the tests) the
values simply become a tensor.

A buffer is reused every step: before it is written again, the event recorded after the
last copy out of it is waited for (the copy has long finished by then in practice: every
step that samples ends with a device-to-host copy)."""

from __future__ import annotations

import torch


class Staging:
    def __init__(self, device: torch.device, dtype: torch.dtype = torch.int64) -> None:
        self.device, self.dtype = device, dtype
        self.pinned = device.type == "cuda"
        self.host = torch.empty(0, dtype=dtype)
        self.on_device = torch.empty(0, dtype=dtype, device=device)
        self.copied = torch.cuda.Event() if self.pinned else None

    def upload(self, values: list[int] | list[float]) -> torch.Tensor:
        """`values` as a 1-D tensor on the device (a view of the staging buffer, valid until
        the next upload)."""
        if not self.pinned:
            return torch.tensor(values, dtype=self.dtype, device=self.device)
        host = self._write(values)
        if host.numel() > self.on_device.numel():
            self.on_device = torch.empty(self.host.numel(), dtype=self.dtype, device=self.device)
        target = self.on_device[: host.numel()]
        target.copy_(host, non_blocking=True)
        self.copied.record()
        return target

    def upload_into(self, values: list[int] | list[float], target: torch.Tensor) -> None:
        """`values` (row-major) into `target`, a tensor of as many elements on the device."""
        if not self.pinned:
            target.copy_(torch.tensor(values, dtype=self.dtype).view(target.shape))
            return
        host = self._write(values)
        target.copy_(host.view(target.shape), non_blocking=True)
        self.copied.record()

    def _write(self, values: list[int] | list[float]) -> torch.Tensor:
        """The pinned buffer's first len(values) entries, holding them (once the last copy
        out of the buffer is done)."""
        self.copied.synchronize()
        if len(values) > self.host.numel():
            size = max(len(values), 2 * self.host.numel(), 1024)
            self.host = torch.empty(size, dtype=self.dtype, pin_memory=True)
        host = self.host[: len(values)]
        host.numpy()[:] = values
        return host
