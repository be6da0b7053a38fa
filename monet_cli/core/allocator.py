"""How PyTorch's CUDA caching allocator sizes a request, as pure functions.

``torch.cuda.max_memory_allocated`` counts allocator blocks, not tensor bytes: every
request is rounded up to a multiple of 512 bytes (``kMinBlockSize``), and with
``PYTORCH_CUDA_ALLOC_CONF=roundup_power2_divisions:N`` a request is rounded up to the next
of N equal steps between two powers of two instead. A CUDA profile records each storage
at its block size so that the simulator adds up what the allocator counts. A zero-byte
request takes no block.

Not modelled, because it depends on the allocator's history rather than on the request: a
large block reused for a smaller request is not split when less than 1 MiB would remain,
and then counts whole. The profile's measured baseline peak shows that gap.
"""

from __future__ import annotations

MIN_BLOCK_BYTES = 512


def cuda_block_bytes(nbytes: int, *, roundup_power2_divisions: int = 0) -> int:
    """Bytes the caching allocator counts for a request of ``nbytes``."""
    if nbytes <= 0:
        return 0
    if nbytes < MIN_BLOCK_BYTES:
        return MIN_BLOCK_BYTES
    if roundup_power2_divisions > 1 and nbytes > MIN_BLOCK_BYTES * roundup_power2_divisions:
        return _next_power2_division(nbytes, roundup_power2_divisions)
    return -(-nbytes // MIN_BLOCK_BYTES) * MIN_BLOCK_BYTES


def _next_power2_division(nbytes: int, divisions: int) -> int:
    if nbytes & (nbytes - 1) == 0:
        return nbytes
    floor = 1 << (nbytes.bit_length() - 1)
    # The allocator divides by the largest power of two not above ``divisions``.
    step = floor >> (divisions.bit_length() - 1)
    if step == 0:
        return floor << 1
    rounded_down = nbytes & ~(step - 1)
    return nbytes if rounded_down == nbytes else rounded_down + step


def roundup_divisions(alloc_conf: str) -> int:
    """``roundup_power2_divisions`` from a ``PYTORCH_CUDA_ALLOC_CONF`` value (0: not set).

    Raises ValueError for the per-size form (``roundup_power2_divisions:[256:1,>:4]``), which
    rounds each size range its own way: monet's rounding would not match it."""
    for item in alloc_conf.split(","):
        key, _, value = item.partition(":")
        if key.strip() != "roundup_power2_divisions":
            continue
        value = value.strip()
        if not value.isdigit():
            raise ValueError(
                f"PYTORCH_CUDA_ALLOC_CONF roundup_power2_divisions:{value}: monet models only one number of divisions"
            )
        return int(value)
    return 0
