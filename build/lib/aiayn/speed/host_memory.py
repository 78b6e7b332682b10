"""Freed host memory kept by the training process for its next step, not handed back to the system.

glibc's malloc serves large blocks with mmap and unmaps them when freed, and trims the top of its
heap; a CPU training step allocates and frees gigabytes of activations and logits, so every step
touches fresh pages again: a page fault for every 4 KiB, which the kernel must also zero (and on a
virtual machine the host may have to back). Turning mmap and trimming off keeps freed blocks in the
heap for the next step's tensors of the same sizes; the process then keeps its peak, which training
reaches in its first steps anyway. It is what the jemalloc or tcmalloc preloads of PyTorch's CPU
tuning guide do, without another library. Linux with glibc only; elsewhere nothing changes.
"""

from __future__ import annotations

import ctypes
import sys

# mallopt(3) parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Tell glibc's malloc, for the rest of this process, to serve every block from its heap (no
    mmap) and never trim the heap. Returns whether it took effect (False off glibc)."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):  # musl and others: mallopt is absent or does nothing
        return False
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # mallopt returns 1 on success; -1 for the trim threshold means "never trim" (mallopt(3))
    return mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, -1) == 1
