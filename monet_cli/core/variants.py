"""Operator variants in the core: where each applies, and what it changes in a profile.

``monet_cli/runtime/variants.py`` runs them. Two exist:

- ``bn_output``: a BatchNorm whose output y feeds only an activation (ReLU, ReLU6,
  Hardtanh) whose output r feeds only convolutions. PyTorch keeps the BatchNorm's input c
  and r (and y, for ReLU6); the variant keeps y alone: the BatchNorm rebuilds its
  centred input from y in backward, the activation keeps its input, and each
  convolution recomputes r from y in its backward node.
- ``maxpool_offsets``: a max-pooling that keeps, instead of its input and its int64
  indices, each maximum's offset inside its window (one or two bytes): the indices are
  rebuilt from them in backward, which needs no input.

An offload (``monet_cli/core/offload.py``) is the same kind of rewrite, and rides along in
``Profile.variants`` once ``with_offload_sites`` has added the sites a CUDA profile offers.

``with_variants`` rewrites a profile as if the chosen variants had run: what each saving
node kept it keeps of another storage (same node, same unpack and release positions),
storages nobody keeps any more die when Python drops them, and what a variant makes in its
forward or rebuilds in its backward becomes a storage of its own for as long as it lives.
The simulator scores that profile like any other, so the solver's rows for a variant come
from the same place as its rows for a segment.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from monet_cli.core.offload import apply_offload, site_plan
from monet_cli.core.profile import PackRecord, Profile, StorageRecord, VariantRecord, VariantSite

BATCH_NORM_OPS = frozenset(
    {
        "aten.native_batch_norm.default",
        "aten._native_batch_norm_legit.default",
        "aten.cudnn_batch_norm.default",
        "aten.miopen_batch_norm.default",
    }
)
ACTIVATION_OPS = {"aten.relu.default": ("ReLU",), "aten.hardtanh.default": ("ReLU6", "Hardtanh")}
CONV_OPS = frozenset({"aten.convolution.default"})
CONV_TYPES = ("Conv1d", "Conv2d", "Conv3d")
MAXPOOL_OPS = frozenset({"aten.max_pool2d_with_indices.default"})
INDEX_BYTES = 8
"""PyTorch's max-pooling indices are int64."""

MIN_BN_WEIGHT = 1e-3
"""A BatchNorm whose weight has an entry smaller than this in magnitude is not offered the
variant, and falls back to keeping its input when applied: rebuilding the input divides by
the weight."""

TOLERANCE = {"bn_output": (1e-3, 1e-4), "maxpool_offsets": (0.0, 0.0), "offload": (0.0, 0.0)}
"""(rtol, atol) a schedule states for each variant. ``bn_output`` is not bit-identical (the
BatchNorm's input is rebuilt from its output, rounding differently): each gradient and
updated parameter element must be within rtol of the unmodified model's value plus atol
times the model's largest gradient magnitude (a gradient that is zero in exact arithmetic,
such as a bias before a BatchNorm, is rounding noise: no relative bound holds for it).
Measured on resnet50 and mobilenet_v2 with every variant on: largest difference a few 1e-6
of the largest gradient (docs/benchmarks.md). ``maxpool_offsets`` runs PyTorch's own
backward kernel on the same indices: bit-exact."""


@dataclass(frozen=True, kw_only=True, slots=True)
class _Change:
    """What one variant does to a profile's storages and packs."""

    moves: dict[tuple[int, int | None], int]
    """(storage, call of the saving node) -> the storage that node keeps instead (-1: none)."""
    new: tuple[StorageRecord, ...]
    """Storages it adds (ids assigned when applied): what it keeps, and its temporaries."""
    kept_new: int | None = None
    """Index into ``new`` of the storage the moved packs point at instead, if any."""
    temporaries: tuple[tuple[int, int | None, int], ...] = ()
    """(storage, call, bytes): a temporary of ``bytes`` while that node's backward runs."""


def innermost_calls(profile: Profile) -> list[int | None]:
    """For each forward op, the innermost module call running it."""
    owner: list[int | None] = [None] * len(profile.ops)
    for call in profile.calls:  # parents come before their children
        for op in range(call.first_op, call.end_op):
            owner[op] = call.index
    return owner


def find_sites(profile: Profile) -> list[VariantSite]:
    """Every place a variant applies, by the profile's ops, calls, storages and packs."""
    if profile.model.precision != "32":
        return []  # under autocast the ops see cast inputs: not offered yet
    owner = innermost_calls(profile)
    sites = []
    for op in profile.ops:
        for impl, finder in (("bn_output", _bn_output_ops), ("maxpool_offsets", _maxpool_ops)):
            ops = finder(profile, owner, op.index)
            if ops is not None:
                modules = tuple(profile.calls[owner[k]].fqn for k in ops)  # type: ignore[index]
                sites.append(VariantSite(impl=impl, ops=ops, modules=modules))  # type: ignore[arg-type]
    return sites


def _bn_output_ops(profile: Profile, owner: list[int | None], bn: int) -> tuple[int, ...] | None:
    """(BatchNorm, activation, convolutions...) when op ``bn`` is a ``bn_output`` site."""
    ops = profile.ops
    if ops[bn].op not in BATCH_NORM_OPS or len(ops[bn].consumers) != 1 or len(ops[bn].inputs) != 1:
        return None
    act = ops[bn].consumers[0]
    convs = ops[act].consumers
    if (
        ops[act].op not in ACTIVATION_OPS
        or not convs
        or any(ops[k].op not in CONV_OPS for k in convs)
        or ops[ops[bn].inputs[0]].consumers != (bn,)
    ):
        return None
    site = (bn, act, *convs)
    types = ("BatchNorm", ACTIVATION_OPS[ops[act].op], CONV_TYPES)
    if not _modules_fit(profile, owner, site, types, shared_ok=(act,)):
        return None
    c, y, r = (_largest_output(profile, k) for k in (ops[bn].inputs[0], bn, act))
    if None in (c, y, r) or any(profile.storages[s].mutated for s in (c, y, r)):  # type: ignore[index]
        return None
    savers = _pack_calls(profile)
    if (
        not savers.get(c, set()) <= {owner[bn]}
        or not savers.get(y, set()) <= {owner[act]}
        or not savers.get(r, set()) <= {owner[k] for k in (act, *convs)}
    ):
        return None
    return site


def _maxpool_ops(profile: Profile, owner: list[int | None], pool: int) -> tuple[int, ...] | None:
    """(pooling,) when op ``pool`` is a ``maxpool_offsets`` site."""
    op = profile.ops[pool]
    if op.op not in MAXPOOL_OPS or not _modules_fit(profile, owner, (pool,), (("MaxPool2d",),)):
        return None
    indices = _indices(profile, owner, pool)
    return (pool,) if indices is not None and not profile.storages[indices].mutated else None


def _modules_fit(
    profile: Profile, owner: list[int | None], site: tuple[int, ...], types: tuple, shared_ok: tuple[int, ...] = ()
) -> bool:
    """Each op runs in a module of its role's type, in place of nothing, called once per step
    (except ``shared_ok`` ops: their variant acts only on the tensors the site makes)."""
    once = _called_once(profile)
    for k, op in enumerate(site):
        call = owner[op]
        kind = types[min(k, len(types) - 1)]
        if call is None or profile.ops[op].inplace_of is not None:
            return False
        name = profile.calls[call].type
        if not (name in kind if isinstance(kind, tuple) else kind in name):
            return False
        if op not in shared_ok and not once[profile.calls[call].fqn]:
            return False
    return True


def _called_once(profile: Profile) -> dict[str, bool]:
    counts: dict[str, int] = {}
    for call in profile.calls:
        counts[call.fqn] = counts.get(call.fqn, 0) + 1
    return {fqn: n == 1 for fqn, n in counts.items()}


def _outputs(profile: Profile, op: int) -> list[StorageRecord]:
    """The activation storages op ``op`` makes."""
    return [s for s in profile.storages if s.producer == op and s.kind == "activation"]


def _largest_output(profile: Profile, op: int) -> int | None:
    made = _outputs(profile, op)
    return max(made, key=lambda s: s.bytes).id if made else None


def _statistic_bytes(profile: Profile, bn: int) -> int:
    """Bytes of one per-channel statistic the BatchNorm op ``bn`` returns (its batch mean): the
    second largest of its outputs, after the normalised tensor."""
    made = sorted((s.bytes for s in _outputs(profile, bn)), reverse=True)
    return made[1] if len(made) > 1 else 0


def _indices(profile: Profile, owner: list[int | None], pool: int) -> int | None:
    """The pooling's indices: the output its own node keeps (the pooled values are not kept by it)."""
    made = {s.id for s in _outputs(profile, pool)}
    kept = [p.storage for p in profile.packs if p.storage in made and p.call == owner[pool]]
    return kept[0] if len(set(kept)) == 1 else None


def _pack_calls(profile: Profile) -> dict[int, set[int | None]]:
    calls: dict[int, set[int | None]] = {}
    for pack in profile.packs:
        calls.setdefault(pack.storage, set()).add(pack.call)
    return calls


def changed_storages(profile: Profile, site: VariantSite, owner: list[int | None]) -> tuple[int, ...]:
    """The profile's storages whose lifetime the variant at ``site`` can change (``owner``:
    ``innermost_calls(profile)``, computed once by the caller)."""
    if site.impl == "offload":
        return site_plan(profile, site).storages
    if site.impl == "bn_output":
        bn, act = site.ops[:2]
        return tuple(_largest_output(profile, k) for k in (profile.ops[bn].inputs[0], bn, act))  # type: ignore[misc]
    pool = site.op
    inputs = {
        p.storage for p in profile.packs if p.call == owner[pool] and profile.storages[p.storage].producer != pool
    }
    return (_indices(profile, owner, pool), *sorted(inputs))  # type: ignore[return-value]


def _change(profile: Profile, owner: list[int | None], record: VariantRecord) -> _Change:
    calls = [owner[k] for k in record.ops]
    if record.impl == "bn_output":
        c, y, r = changed_storages(profile, record, owner)
        bn_call, act_call, conv_calls = calls[0], calls[1], calls[2:]
        moves = {(c, bn_call): y, (r, act_call): y, **{(r, call): y for call in conv_calls}}
        storages = profile.storages
        # The BatchNorm rebuilds its centred input and passes a zero mean of one statistic's
        # size; each convolution rebuilds its activation.
        rebuilt = storages[c].bytes + _statistic_bytes(profile, record.ops[0])
        temporaries = ((c, bn_call, rebuilt), *((r, call, storages[r].bytes) for call in conv_calls))
        return _Change(moves=moves, new=(), temporaries=temporaries)
    indices, *inputs = changed_storages(profile, record, owner)
    pool, call = record.op, calls[0]
    elements = profile.storages[indices].bytes // INDEX_BYTES
    offsets = StorageRecord(
        id=-1, bytes=record.saved_bytes, kind="activation", producer=pool, alloc=pool, free=pool + 1
    )
    # Forward: the int64 offsets before they are narrowed; backward: the int64 indices rebuilt.
    narrowing = StorageRecord(
        id=-1, bytes=elements * INDEX_BYTES, kind="temp", producer=None, alloc=pool, free=pool + 1
    )
    moves = {(indices, call): -2, **{(sid, call): -1 for sid in inputs}}
    return _Change(
        moves=moves, new=(offsets, narrowing), kept_new=0, temporaries=((indices, call, elements * INDEX_BYTES),)
    )


def with_variants(profile: Profile, chosen: Iterable[int]) -> Profile:
    """``profile`` as if the variants ``chosen`` (indices into ``profile.variants``) had run."""
    packs: list[PackRecord | None] = list(profile.packs)
    storages = list(profile.storages)
    owner = innermost_calls(profile)
    for index in sorted(set(chosen)):
        record = profile.variants[index]
        if record.impl == "offload":
            apply_offload(profile, record, packs, storages)
        else:
            _apply(_change(profile, owner, record), packs, storages)
    kept = [p for p in packs if p is not None]
    return replace(profile, packs=tuple(kept), storages=tuple(storages))


def _apply(change: _Change, packs: list[PackRecord | None], storages: list[StorageRecord]) -> None:
    first_new = len(storages)
    storages += [replace(s, id=first_new + k) for k, s in enumerate(change.new)]
    touched = {sid for sid, _ in change.moves}
    pending = {(sid, call): nbytes for sid, call, nbytes in change.temporaries}
    for k, pack in enumerate(packs):
        if pack is None or (pack.storage, pack.call) not in change.moves:
            continue
        target = change.moves[(pack.storage, pack.call)]
        if target == -2 and change.kept_new is not None:
            target = first_new + change.kept_new
        packs[k] = None if target == -1 else replace(pack, storage=target)
        touched.add(target)
        nbytes = pending.pop((pack.storage, pack.call), None)
        if nbytes is not None and pack.unpack is not None and pack.release is not None:
            storages.append(
                StorageRecord(
                    id=len(storages), bytes=nbytes, kind="temp", producer=None, alloc=pack.unpack, free=pack.release
                )
            )
    for sid in sorted(touched - {-1}):
        storages[sid] = replace(storages[sid], free=_free_when_saved(storages[sid], packs))


def _free_when_saved(storage: StorageRecord, packs: list[PackRecord | None]) -> int | None:
    """When ``storage`` dies: when Python drops it, or when the last node saving it releases it."""
    ends = [p.release for p in packs if p is not None and p.storage == storage.id]
    dropped = storage.free_no_autograd if storage.free_no_autograd is not None else storage.free
    if storage.producer is None and storage.kind != "activation":
        dropped = storage.free  # a temporary, or what existed before the step: its own end
    if dropped is None or None in ends:
        return None
    return max([dropped, *ends])  # type: ignore[type-var]
