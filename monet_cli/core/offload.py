"""Offload in the core: which saved tensors a module call can move to host memory, what that
costs, and what it does to a profile. ``monet_cli/runtime/offload.py`` runs it.

Offered only where the profile measured host-device copies (``Profile.transfer``, CUDA): on
a CPU there is no other memory to move to. An offload covers one module call. During its
forward every storage it makes, that autograd saves only inside the call and that nothing
after the call reads, is copied to pinned host memory on a side stream as it is saved;
when the call returns the step waits for those copies and the device copies die with
Python's last reference. In backward each comes back to the device when a node first
unpacks it (a copy on the compute stream, so the step waits for it) and dies when the last
node saving it is done.

The simulator sees an offload as a rewrite of the profile, like an operator variant
(``monet_cli/core/variants.py``): each moved storage lives until the later of Python
dropping it and the call's end, and a new storage, its device copy in backward, lives from
its first unpack to its last release. Its time is computed from the measured copy speed:
the copies out that the call's own forward does not hide, plus every copy back.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import replace

from monet_cli.core.profile import ModuleCall, PackRecord, Profile, StorageRecord, Transfer, VariantRecord, VariantSite

MIN_OFFLOAD_BYTES = 1 << 20
"""A call whose movable storages add up to less is not offered: the copies' fixed cost and
the hooks would cost more than the memory is worth."""


def transfer_ms(transfer: Transfer, nbytes: int, *, to_host: bool) -> float:
    rate = transfer.to_host_bytes_per_ms if to_host else transfer.to_device_bytes_per_ms
    return transfer.fixed_ms + nbytes / rate


def _inside(profile: Profile) -> list[set[int]]:
    """For each call: itself and every call it runs (its sub-calls, at any depth)."""
    inside = [{call.index} for call in profile.calls]
    for call in reversed(profile.calls):  # children come after their parents
        if call.parent is not None:
            inside[call.parent] |= inside[call.index]
    return inside


def call_packs(profile: Profile, call: int, inside: list[set[int]] | None = None) -> list[int]:
    """The packs autograd makes while ``call``'s forward runs, in the order it makes them."""
    inside = inside or _inside(profile)
    return [k for k, pack in enumerate(profile.packs) if pack.call in inside[call]]


def _savers(profile: Profile) -> dict[int, set[int]]:
    """Storage -> the packs that save it."""
    savers: dict[int, set[int]] = defaultdict(set)
    for k, pack in enumerate(profile.packs):
        savers[pack.storage].add(k)
    return savers


def movable_storages(profile: Profile, call: ModuleCall, packs: list[int],
                     savers: dict[int, set[int]] | None = None) -> list[int]:
    """The storages an offload of ``call`` moves: activations it makes, saved only by its own
    ``packs``, never written in place, and dropped by Python before the call returns (nothing
    after it reads them: not its outputs)."""
    savers = savers or _savers(profile)
    ours = set(packs)
    found = []
    for sid in sorted({profile.packs[k].storage for k in packs}):
        s = profile.storages[sid]
        if not savers[sid] <= ours or s.kind != "activation" or s.producer is None or s.mutated:
            continue
        if call.first_op <= s.producer < call.end_op and s.free_no_autograd is not None \
                and s.free_no_autograd <= call.end_op:
            found.append(sid)
    return found


def moved_packs(profile: Profile, call: int) -> tuple[int, ...]:
    """Which of the saves ``call``'s forward makes (their ordinals, counted from 0 as the call
    makes them) hand over a storage its offload moves: what the runtime copies out."""
    packs = call_packs(profile, call)
    storages = set(movable_storages(profile, profile.calls[call], packs))
    return tuple(n for n, k in enumerate(packs) if profile.packs[k].storage in storages)


def offload_sites(profile: Profile) -> tuple[VariantRecord, ...]:
    """Every call worth offloading, as a rewrite record (empty without a measured ``transfer``)."""
    if profile.transfer is None:
        return ()
    inside, savers = _inside(profile), _savers(profile)
    calls_per_module = Counter(call.fqn for call in profile.calls)
    sites = []
    for call in profile.calls:
        if calls_per_module[call.fqn] > 1:
            continue  # the runtime hooks a module, which would offload every one of its calls
        packs = call_packs(profile, call.index, inside)
        storages = movable_storages(profile, call, packs, savers)
        nbytes = sum(profile.storages[sid].bytes for sid in storages)
        if nbytes < MIN_OFFLOAD_BYTES or any(profile.packs[k].unpack is None for k in packs
                                             if profile.packs[k].storage in storages):
            continue
        sizes = [profile.storages[sid].bytes for sid in storages]
        sites.append(VariantRecord(
            impl="offload", ops=tuple(range(call.first_op, call.end_op)), modules=(call.fqn,),
            time_ms=round(_cost_ms(profile, call, sizes, len(packs)), 4),
            saved_bytes=0, native_saved_bytes=nbytes,
        ))
    return tuple(sites)


def _cost_ms(profile: Profile, call: ModuleCall, sizes: list[int], saves: int) -> float:
    """Copies out beyond the call's own forward time (they run beside it), plus copies back
    (the compute stream waits for each), plus the saved-tensor hooks every save of the call
    goes through (priced as checkpoint's, measured by the profile)."""
    assert profile.transfer is not None
    out_ms = sum(transfer_ms(profile.transfer, n, to_host=True) for n in sizes)
    forward_ms = sum(op.time_ms for op in profile.ops[call.first_op:call.end_op])
    back_ms = sum(transfer_ms(profile.transfer, n, to_host=False) for n in sizes)
    return max(0.0, out_ms - forward_ms) + back_ms + saves * profile.overheads.saved_tensor_ms


def with_offload_sites(profile: Profile) -> Profile:
    """``profile`` with its offload sites appended to its variants (the solver's choices)."""
    sites = offload_sites(profile)
    return replace(profile, variants=profile.variants + sites) if sites else profile


def site_call(profile: Profile, site: VariantSite) -> ModuleCall:
    """The call an offload site covers."""
    return next(c for c in profile.calls if c.fqn == site.module and c.first_op == site.op)


def offload_storages(profile: Profile, site: VariantSite) -> list[int]:
    call = site_call(profile, site)
    return movable_storages(profile, call, call_packs(profile, call.index))


def apply_offload(profile: Profile, site: VariantSite, packs: list[PackRecord | None],
                  storages: list[StorageRecord]) -> None:
    """Rewrite ``packs`` and ``storages`` (lists of ``profile``'s, changed in place) as if
    ``site``'s offload ran."""
    call = site_call(profile, site)
    for sid in offload_storages(profile, site):
        moved = [k for k, p in enumerate(packs) if p is not None and p.storage == sid]
        unpacks = [packs[k].unpack for k in moved]  # type: ignore[union-attr]
        releases = [packs[k].release for k in moved]  # type: ignore[union-attr]
        back = StorageRecord(id=len(storages), bytes=storages[sid].bytes, kind="activation", producer=None,
                             alloc=min(unpacks), free=None if None in releases else max(releases))  # type: ignore
        storages.append(back)
        for k in moved:
            packs[k] = replace(packs[k], storage=back.id)  # type: ignore[type-var]
        original = storages[sid]
        storages[sid] = replace(original, free=max(original.free_no_autograd, call.end_op))  # type: ignore[type-var]
