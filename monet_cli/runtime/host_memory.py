"""Keep the host memory a step frees for the next step, so that steps are timed without page faults.

glibc's malloc serves large requests with fresh ``mmap`` pages and hands them back on
``free``, and trims the top of its heap whenever enough of it is free; the next step then
faults every page in again. Whether a step does so depends on the process's history (where
the heap's last live block sits), not on the model: on the unet (batch 16, this 2-core CPU
VM) the steps of one profile took about 10,000 minor faults each and ran at 67 ms, while the
same workload in another state ran at 59 ms with none. The profile's step time, which every
predicted overhead is a ratio to, came out 12 to 14% above the bench's, and the unet's points
4 to 6 points above their predictions. With malloc told to keep what it frees, the steps of
that profile took no faults and ran at 55 to 59 ms, and the profile's step came out within
2% of the bench's.

This is what a caching allocator (PyTorch's on CUDA, or jemalloc and tcmalloc on CPU) does
anyway. A training loop of the user's own gets the same with the environment variables
``MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647``.
"""

from __future__ import annotations

import ctypes
import platform

M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
"""``mallopt`` parameters (glibc's malloc.h)."""
NEVER_TRIM = 2**31 - 1
"""The largest trim threshold ``mallopt`` takes (an int): free memory at the heap's top stays."""


def keep_freed_host_memory() -> bool:
    """Tell glibc's malloc, for the rest of the process, to serve every request from its heap
    and never give the heap back: True where that took (Linux with glibc), False elsewhere
    (other C libraries keep their own ways, and nothing changes)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, NEVER_TRIM))
