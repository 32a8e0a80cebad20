"""The engine's host allocator settings: a step's large temporaries reuse freed memory
(no page faults on the next step), and sleep can still give that memory back."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest
import torch

from hotswap.execution.host_memory import _glibc, return_freed_memory, reuse_freed_memory

pytestmark = pytest.mark.skipif(_glibc() is None, reason="the C library is not glibc")

TEMPORARY_BYTES = 96 << 20  # above glibc's largest automatic mmap threshold (32 MiB)


def faults_to_fill(nbytes: int) -> int:
    """Minor page faults taken to allocate and write a fresh tensor of `nbytes`."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    temporary = torch.empty(nbytes, dtype=torch.uint8)
    temporary.fill_(1)
    del temporary
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def rss_bytes() -> int:
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize()


def test_a_freed_step_temporary_is_reused_without_page_faults() -> None:
    """On fresh pages every page of a fill faults (24576 here). With freed blocks kept,
    fills stop faulting once the heap has grown past its fragmentation (glibc aligns
    these blocks, which leaves remainders between them: measured, 2-6 fills here)."""
    assert reuse_freed_memory()
    pages = TEMPORARY_BYTES // resource.getpagesize()
    faulting = [faults_to_fill(TEMPORARY_BYTES) > pages // 20 for _ in range(12)]
    assert faulting[-3:] == [False] * 3, faulting


def test_returning_freed_memory_shrinks_the_process() -> None:
    reuse_freed_memory()
    held = torch.ones(TEMPORARY_BYTES, dtype=torch.uint8)
    del held  # kept in the heap, still resident
    before = rss_bytes()
    return_freed_memory()
    assert before - rss_bytes() > TEMPORARY_BYTES // 2
