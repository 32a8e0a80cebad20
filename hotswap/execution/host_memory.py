"""Host memory for step temporaries: freed blocks are reused, not handed back and faulted
in again.

glibc gives an allocation above its mmap threshold (adjusted at run time, at most 32 MiB)
pages of its own from the kernel: each page faults in at first touch, and the whole
mapping is returned on free. An engine step's large temporaries are such allocations and
recur every step: 256 sampled rows of a 49k vocabulary are 50 MB of float32 logits, and
the sampler makes a few more of that size. Faulting them in cost more than computing them
(measured on the default model's shapes: a 50 MB clone 11.5 ms on fresh pages, 2.2 ms on
reused ones; the sampler's whole pass over 256 rows 108 ms vs 42 ms). An engine on the
CPU therefore raises the mmap and trim thresholds once per process (`reuse_freed_memory`),
so freed blocks stay in the heap for the next step, and sleep mode gives free heap pages
back to the system (`return_freed_memory`). Where the C library is not glibc, both do
nothing.
"""

from __future__ import annotations

import ctypes
import functools
import logging

logger = logging.getLogger(__name__)

# Allocations above this still get a mapping of their own (returned on free): big one-off
# buffers, such as a large model's embedding, are not kept in the heap after they go.
MMAP_THRESHOLD_BYTES = 256 << 20
# The heap's free top is returned to the system only beyond this (glibc's M_TRIM_THRESHOLD)
TRIM_THRESHOLD_BYTES = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)  # the C library this process already runs on
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: mallopt's numbers are its own
    except (OSError, AttributeError):
        return None
    return libc


@functools.cache
def reuse_freed_memory() -> bool:
    """Keep freed blocks of up to MMAP_THRESHOLD_BYTES in the heap, for this whole process
    (once; later calls do nothing). False where that cannot be set."""
    libc = _glibc()
    if libc is None:
        return False
    done = libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    done = libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and done
    if not done:
        logger.debug("mallopt refused the thresholds; large temporaries use fresh pages")
    return done


def return_freed_memory() -> None:
    """Give the heap's free pages back to the system (after sleep freed the KV cache)."""
    libc = _glibc()
    if libc is not None:
        libc.malloc_trim(0)
