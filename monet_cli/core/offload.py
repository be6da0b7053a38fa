"""Offload in the core: which saved tensors a module call can move to host memory, what that
costs, and what it does to a profile. ``monet_cli/runtime/offload.py`` runs it.

Offered only where the profile measured host-device copies (``Profile.transfer``, CUDA): on
a CPU there is no other memory to move to. An offload covers one module call. During its
forward every storage it makes, that autograd saves only inside the call and that nothing
after the call reads, is copied to pinned host memory on a side stream as it is saved;
when the call returns the step waits for those copies and the device copies die with
Python's last reference. In backward they come back one after another on the side stream,
one ahead of need: the first when backward first unpacks anything the call saved, each next
one when the one before it is first unpacked; each dies when the last node saving it is done.

The simulator sees an offload as a rewrite of the profile, like an operator variant
(``monet_cli/core/variants.py``): each moved storage lives until the later of Python
dropping it and the call's end, and a new storage, its device copy in backward, lives from
when it comes back to its last release. Its time is computed from the measured copy speed
and the profiled op times: the copies out that the call's own forward does not hide, and the
waits where backward needs a copy back that has not arrived.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, replace

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


def movable_storages(
    profile: Profile, call: ModuleCall, packs: list[int], savers: dict[int, set[int]] | None = None
) -> list[int]:
    """The storages an offload of ``call`` moves: activations it makes on the device (not
    the host scalars a CUDA step also saves, counted 0 bytes), saved only by its own
    ``packs``, never written in place, and dropped by Python before the call returns (nothing
    after it reads them: not its outputs)."""
    savers = savers or _savers(profile)
    ours = set(packs)
    found = []
    for sid in sorted({profile.packs[k].storage for k in packs}):
        s = profile.storages[sid]
        if not s.bytes or not savers[sid] <= ours or s.kind != "activation" or s.producer is None or s.mutated:
            continue
        if (
            call.first_op <= s.producer < call.end_op
            and s.free_no_autograd is not None
            and s.free_no_autograd <= call.end_op
        ):
            found.append(sid)
    return found


@dataclass(frozen=True, kw_only=True, slots=True)
class CallOffload:
    """How an offload of one call runs, from the profile."""

    call: ModuleCall
    packs: tuple[int, ...]
    """The profile's packs made while the call's forward runs, in the order it makes them."""
    storages: tuple[int, ...]
    """The storages it moves, in the order backward first unpacks them (the order they come back)."""
    returns: tuple[int, ...]
    """Backward position at which each comes back: the first when backward first unpacks
    anything the call saved, each next one when the one before it is first unpacked (a
    prefetch one storage ahead)."""
    needed: tuple[int, ...]
    """Backward position at which each is first unpacked."""

    def ordinals(self, profile: Profile) -> tuple[int, ...]:
        """Ordinals (among the call's saves) of the saves that hand over a moved storage."""
        moved = set(self.storages)
        return tuple(n for n, k in enumerate(self.packs) if profile.packs[k].storage in moved)

    def fetch_order(self, profile: Profile) -> tuple[int, ...]:
        """Each moved storage named by the ordinal of its first save, in the order it comes back."""
        first = {}
        for n, k in enumerate(self.packs):
            first.setdefault(profile.packs[k].storage, n)
        return tuple(first[sid] for sid in self.storages)


def plan_offload(
    profile: Profile, call: ModuleCall, inside: list[set[int]] | None = None, savers: dict[int, set[int]] | None = None
) -> CallOffload | None:
    """None when the call moves nothing, or something it would move is never unpacked."""
    packs = call_packs(profile, call.index, inside)
    storages = movable_storages(profile, call, packs, savers)
    moved = set(storages)
    unpacks: dict[int, list[int | None]] = defaultdict(list)
    for k in packs:
        if profile.packs[k].storage in moved:
            unpacks[profile.packs[k].storage].append(profile.packs[k].unpack)
    if not storages or any(None in u for u in unpacks.values()):
        return None
    needed = {sid: min(u) for sid, u in unpacks.items()}  # type: ignore[type-var]
    order = sorted(storages, key=lambda sid: (needed[sid], sid))
    start = min(profile.packs[k].unpack for k in packs if profile.packs[k].unpack is not None)  # type: ignore[type-var]
    returns = (start, *(needed[sid] for sid in order[:-1]))
    return CallOffload(
        call=call,
        packs=tuple(packs),
        storages=tuple(order),
        returns=returns,
        needed=tuple(needed[sid] for sid in order),
    )


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
        plan = plan_offload(profile, call, inside, savers)
        nbytes = 0 if plan is None else sum(profile.storages[sid].bytes for sid in plan.storages)
        if plan is None or nbytes < MIN_OFFLOAD_BYTES:
            continue
        sites.append(
            VariantRecord(
                impl="offload",
                ops=tuple(range(call.first_op, call.end_op)),
                modules=(call.fqn,),
                time_ms=round(_cost_ms(profile, plan), 4),
                saved_bytes=0,
                native_saved_bytes=nbytes,
            )
        )
    return tuple(sites)


def _cost_ms(profile: Profile, plan: CallOffload) -> float:
    """Copies out beyond the call's own forward time (they run beside it), the waits for
    copies back that backward catches up with, and the saved-tensor hooks every save of the
    call goes through (priced as checkpoint's, measured by the profile)."""
    transfer = profile.transfer
    assert transfer is not None
    sizes = [profile.storages[sid].bytes for sid in plan.storages]
    out_ms = sum(transfer_ms(transfer, n, to_host=True) for n in sizes)
    forward_ms = sum(op.time_ms for op in profile.ops[plan.call.first_op : plan.call.end_op])
    return (
        max(0.0, out_ms - forward_ms)
        + _backward_wait_ms(profile, plan, sizes)
        + len(plan.packs) * profile.overheads.saved_tensor_ms
    )


def _backward_wait_ms(profile: Profile, plan: CallOffload, sizes: list[int]) -> float:
    """Copies back run one after another on the side stream, each started when it is
    prefetched; backward waits where it needs one that has not arrived."""
    assert profile.transfer is not None
    first = len(profile.ops)
    clock = [0.0]
    for op in profile.backward:
        clock.append(clock[-1] + op.time_ms)  # clock[p - first]: backward time before position p

    def at(pos: int) -> float:
        return clock[min(max(pos - first, 0), len(clock) - 1)]

    waited = side_free = 0.0
    for nbytes, issued, needed in zip(sizes, plan.returns, plan.needed):
        done = max(at(issued) + waited, side_free) + transfer_ms(profile.transfer, nbytes, to_host=False)
        side_free = done
        waited += max(0.0, done - (at(needed) + waited))
    return waited


def with_offload_sites(profile: Profile) -> Profile:
    """``profile`` with its offload sites appended to its variants (the solver's choices)."""
    sites = offload_sites(profile)
    return replace(profile, variants=profile.variants + sites) if sites else profile


def site_call(profile: Profile, site: VariantSite) -> ModuleCall:
    """The call an offload site covers."""
    return next(c for c in profile.calls if c.fqn == site.module and c.first_op == site.op)


def site_plan(profile: Profile, site: VariantSite) -> CallOffload:
    plan = plan_offload(profile, site_call(profile, site))
    assert plan is not None, "an offload site moves something"
    return plan


def apply_offload(
    profile: Profile, site: VariantSite, packs: list[PackRecord | None], storages: list[StorageRecord]
) -> None:
    """Rewrite ``packs`` and ``storages`` (lists of ``profile``'s, changed in place) as if
    ``site``'s offload ran."""
    plan = site_plan(profile, site)
    saving: dict[int, list[int]] = defaultdict(list)
    for k, pack in enumerate(packs):
        if pack is not None:
            saving[pack.storage].append(k)
    for sid, back_at in zip(plan.storages, plan.returns):
        moved = saving[sid]
        releases = [packs[k].release for k in moved]  # type: ignore[union-attr]
        back = StorageRecord(
            id=len(storages),
            bytes=storages[sid].bytes,
            kind="activation",
            producer=None,
            alloc=back_at,
            free=None if None in releases else max(releases),
        )  # type: ignore
        storages.append(back)
        for k in moved:
            packs[k] = replace(packs[k], storage=back.id)  # type: ignore[type-var]
        original = storages[sid]
        end = plan.call.end_op
        storages[sid] = replace(original, free=max(original.free_no_autograd, end))  # type: ignore[type-var]
