"""Shared-memory segments: what one side writes the other sees; unlinking removes the name
but not mappings already made; a missing name is an error, never created."""

from __future__ import annotations

import gc

import pytest
import torch

from hotswap.weight_transfer.shm import SHM_DIR, Segment


def test_attach_sees_the_creators_bytes_and_unlink_keeps_mappings() -> None:
    created = Segment.create(4096)
    attached = Segment.attach(created.name)
    assert attached.size == 4096 and attached.is_current()
    created.data[:4].copy_(torch.tensor([1, 2, 3, 4], dtype=torch.uint8))
    assert attached.data[:4].tolist() == [1, 2, 3, 4]
    created.unlink()
    assert not (SHM_DIR / created.name).exists()
    assert not attached.is_current()
    attached.data[4] = 9  # the mapping outlives the name
    assert int(created.data[4]) == 9


def test_segment_is_unlinked_when_collected() -> None:
    segment = Segment.create(64)
    path = segment.path
    assert path.exists()
    del segment
    gc.collect()
    assert not path.exists()


def test_attach_to_a_missing_name_creates_nothing() -> None:
    with pytest.raises(ValueError, match="no shared-memory segment 'hotswap_missing_x'"):
        Segment.attach("hotswap_missing_x")
    assert not (SHM_DIR / "hotswap_missing_x").exists()
