"""How PyTorch's CUDA caching allocator sizes a request, as pure functions.

``torch.cuda.max_memory_allocated`` counts allocator blocks, not tensor bytes: every
request is rounded up to a multiple of 512 bytes (``kMinBlockSize``), and with
``PYTORCH_CUDA_ALLOC_CONF=roundup_power2_divisions:N`` a request is rounded up to the next
of N equal steps between two powers of two instead. A CUDA profile records each storage
at its block size so that the simulator adds up what the allocator counts. A zero-byte
request takes no block.

What no sum of requests counts, because it depends on the allocator's history: a large block
reused for a smaller request is not split when 1 MiB or less would remain, and then counts
whole. ``CachingAllocator`` replays those blocks for a step's events: on an H200 profile of
resnet50 it finds 16 of the 18 MiB by which the measured peak exceeds the requests' sum.
Where the profile's allocator leaves blocks unsplit (``leaves_blocks_unsplit``), the
simulator's peak is the replay's, so the solver plans with it.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

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


def _setting(alloc_conf: str, name: str) -> str | None:
    """The value of setting ``name`` in a ``PYTORCH_CUDA_ALLOC_CONF`` value (None: not set)."""
    for item in alloc_conf.split(","):
        key, _, value = item.partition(":")
        if key.strip() == name:
            return value.strip()
    return None


def roundup_divisions(alloc_conf: str) -> int:
    """``roundup_power2_divisions`` from a ``PYTORCH_CUDA_ALLOC_CONF`` value (0: not set).

    Raises ValueError for the per-size form (``roundup_power2_divisions:[256:1,>:4]``), which
    rounds each size range its own way: monet's rounding would not match it."""
    value = _setting(alloc_conf, "roundup_power2_divisions")
    if value is None:
        return 0
    if not value.isdigit():
        raise ValueError(
            f"PYTORCH_CUDA_ALLOC_CONF roundup_power2_divisions:{value}: monet models only one number of divisions"
        )
    return int(value)


def expandable_segments(alloc_conf: str) -> bool:
    """Whether a ``PYTORCH_CUDA_ALLOC_CONF`` value turns on ``expandable_segments``."""
    return (_setting(alloc_conf, "expandable_segments") or "").lower() == "true"


def max_split_bytes(alloc_conf: str) -> int | None:
    """``max_split_size_mb`` from a ``PYTORCH_CUDA_ALLOC_CONF`` value, in bytes (None: not set,
    every large block may be split). PyTorch itself refuses values it does not accept."""
    return _mib_setting(alloc_conf, "max_split_size_mb")


def non_split_rounding_bytes(alloc_conf: str) -> int:
    """``max_non_split_rounding_mb``, in bytes: how far beyond a request at or over
    ``max_split_size_mb`` a cached block may be and still serve it whole (default 20 MiB)."""
    value = _mib_setting(alloc_conf, "max_non_split_rounding_mb")
    return LARGE_SEGMENT_BYTES if value is None else value


def _mib_setting(alloc_conf: str, name: str) -> int | None:
    value = _setting(alloc_conf, name)
    if value is None:
        return None
    if not value.isdigit():
        raise ValueError(f"PYTORCH_CUDA_ALLOC_CONF {name}:{value}: expected a whole number of MiB")
    return int(value) << 20


def same_counting(alloc_conf: str, other: str) -> bool:
    """Whether two ``PYTORCH_CUDA_ALLOC_CONF`` values size and count blocks alike, as far as monet
    models it: rounding, whether blocks stay unsplit and which blocks may be split."""
    return all(
        rule(alloc_conf) == rule(other)
        for rule in (
            leaves_blocks_unsplit,
            lambda conf: _setting(conf, "roundup_power2_divisions"),
            max_split_bytes,
            non_split_rounding_bytes,
        )
    )


def leaves_blocks_unsplit(alloc_conf: str) -> bool:
    """Whether the allocator these settings give may count a block beyond its request (the
    native one without expandable segments); ``cudaMallocAsync`` is not modelled, and its
    peak is taken as the requests' sum."""
    return not expandable_segments(alloc_conf) and _setting(alloc_conf, "backend") != "cudaMallocAsync"


# -- the allocator's blocks ------------------------------------------------------------------

SMALL_REQUEST_BYTES = 1 << 20
"""Requests up to this size come from the small pool (``kSmallSize``); it is also the most a
large block may keep unsplit beyond a request."""
SMALL_SEGMENT_BYTES = 2 << 20
LARGE_SEGMENT_BYTES = 20 << 20
"""Large requests under ``MID_REQUEST_BYTES`` get a segment this size, to share."""
MID_REQUEST_BYTES = 10 << 20
SEGMENT_ROUNDING_BYTES = 2 << 20


class _Block:
    __slots__ = ("ptr", "size", "free", "prev", "next", "small")

    def __init__(self, ptr: int, size: int, small: bool) -> None:
        self.ptr, self.size, self.small = ptr, size, small
        self.free = True
        self.prev: _Block | None = None
        self.next: _Block | None = None

    def key(self) -> tuple[int, int]:
        return (self.size, self.ptr)


class CachingAllocator:
    """PyTorch's native CUDA caching allocator, as far as what it counts goes (one stream).

    A request takes the smallest cached free block that holds it (the lowest address among
    equals), else a new segment: 2 MiB for small requests, 20 MiB for large ones under
    10 MiB, the request rounded up to 2 MiB above. The block is split unless too little would
    remain: under 512 bytes in the small pool, 1 MiB or less in the large pool (with
    ``expandable_segments`` every block is split as in the small pool, so the peak is the
    requests' sum: ``leaves_blocks_unsplit``). An unsplit block counts whole in
    ``allocated_bytes``, which is why the allocator's peak can exceed the sum of the requests.
    A freed block merges with free neighbours of its segment.

    With ``max_split_size_mb`` (``max_split_bytes``), a large block at or over it is never
    split: a smaller request does not take it, and a request at or over it takes it whole only
    if it is less than ``max_non_split_rounding_mb`` larger (PyTorch's ``get_free_block``
    and ``should_split``)."""

    def __init__(
        self, *, max_split_bytes: int | None = None, non_split_rounding_bytes: int = LARGE_SEGMENT_BYTES
    ) -> None:
        self.max_split_bytes = max_split_bytes
        self.non_split_rounding_bytes = non_split_rounding_bytes
        self.allocated_bytes = 0
        self.peak_bytes = 0
        self._pools: dict[bool, list[tuple[int, int, _Block]]] = {True: [], False: []}
        self._next_segment = 0

    def malloc(self, nbytes: int) -> _Block:
        nbytes = cuda_block_bytes(nbytes)  # a no-op on sizes already rounded (a profile's)
        small = nbytes <= SMALL_REQUEST_BYTES
        pool = self._pools[small]
        index = bisect.bisect_left(pool, (nbytes, -1))
        if index < len(pool) and (small or self._may_take(pool[index][0], nbytes)):
            block = pool.pop(index)[2]
        else:
            block = self._segment(nbytes, small)
        remaining = block.size - nbytes
        if (
            (remaining >= MIN_BLOCK_BYTES)
            if small
            else (remaining > SMALL_REQUEST_BYTES and not self._oversize(nbytes))
        ):
            self._split(block, nbytes)
        block.free = False
        self.allocated_bytes += block.size
        self.peak_bytes = max(self.peak_bytes, self.allocated_bytes)
        return block

    def free(self, block: _Block) -> None:
        block.free = True
        self.allocated_bytes -= block.size
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.free:
                self._remove(neighbour)
                block = self._merge(neighbour, block) if neighbour is block.prev else self._merge(block, neighbour)
        self._insert(block)

    def _oversize(self, nbytes: int) -> bool:
        return self.max_split_bytes is not None and nbytes >= self.max_split_bytes

    def _may_take(self, size: int, nbytes: int) -> bool:
        """Whether a request of ``nbytes`` may take the smallest cached large block that holds
        it, of ``size``: if not, no larger one may either, and a new segment serves it."""
        if self._oversize(nbytes):
            return size < nbytes + self.non_split_rounding_bytes
        return not self._oversize(size)

    def _segment(self, nbytes: int, small: bool) -> _Block:
        if small:
            size = SMALL_SEGMENT_BYTES
        elif nbytes < MID_REQUEST_BYTES:
            size = LARGE_SEGMENT_BYTES
        else:
            size = -(-nbytes // SEGMENT_ROUNDING_BYTES) * SEGMENT_ROUNDING_BYTES
        block = _Block(self._next_segment, size, small)
        self._next_segment += size + SEGMENT_ROUNDING_BYTES  # a gap: segments never merge
        return block

    def _split(self, block: _Block, nbytes: int) -> None:
        rest = _Block(block.ptr + nbytes, block.size - nbytes, block.small)
        rest.prev, rest.next = block, block.next
        if block.next is not None:
            block.next.prev = rest
        block.next, block.size = rest, nbytes
        self._insert(rest)

    @staticmethod
    def _merge(first: _Block, second: _Block) -> _Block:
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        return first

    def _insert(self, block: _Block) -> None:
        bisect.insort(self._pools[block.small], (block.size, block.ptr, block))

    def _remove(self, block: _Block) -> None:
        pool = self._pools[block.small]
        pool.pop(bisect.bisect_left(pool, block.key()))


def allocator_peak(
    spans: Sequence[tuple[tuple[int, ...], tuple[int, ...], int]],
    *,
    resident: Sequence[int],
    alloc_conf: str = "",
) -> int:
    """The allocator's peak in the second of two identical steps (the first leaves the cache
    as a warm-up step leaves it for a measured one): ``spans`` are each storage's (alloc key,
    free key, bytes) in a step, ``resident`` the indices of those made before the first step
    and kept after the last (parameters, optimizer state, inputs, what the allocator held
    beyond tensors); ``alloc_conf`` the ``PYTORCH_CUDA_ALLOC_CONF`` the step ran under."""
    allocator = CachingAllocator(
        max_split_bytes=max_split_bytes(alloc_conf), non_split_rounding_bytes=non_split_rounding_bytes(alloc_conf)
    )
    kept = set(resident)
    # Their blocks are counted as the profile measured them (the bytes the allocator held
    # beyond the tensors are one of them): whatever segments they sit in are full.
    allocator.allocated_bytes = sum(spans[index][2] for index in kept)
    events = sorted(
        (key, made, index)
        for index, (alloc, free, nbytes) in enumerate(spans)
        if index not in kept and nbytes  # a zero-byte request takes no block
        for key, made in ((alloc, 1), (free, 0))
    )
    for _ in range(2):
        allocator.peak_bytes = allocator.allocated_bytes
        live: dict[int, _Block] = {}
        for _, made, index in events:
            if made:
                live[index] = allocator.malloc(spans[index][2])
            elif index in live:
                allocator.free(live.pop(index))
        for block in live.values():  # what outlives a step (gradients) is gone before the next
            allocator.free(block)
    return allocator.peak_bytes
