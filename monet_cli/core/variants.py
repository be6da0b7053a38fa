"""Operator variants in the core: where one applies, and what it changes in a profile.

The one variant, ``bn_output`` (``monet_cli/runtime/variants.py`` runs it), applies to a
BatchNorm whose output y feeds only an activation (ReLU, ReLU6, Hardtanh) whose output r
feeds only convolutions. PyTorch keeps the BatchNorm's input c and r (and y, for ReLU6);
the variant keeps y alone: the BatchNorm rebuilds c from y in backward, the activation
keeps its input, and each convolution recomputes r from y in its backward node.

``with_variants`` rewrites a profile as if the chosen variants had run: every tensor the
three kinds of node saved of c or r they now save of y (same nodes, same unpack and
release positions), c and r die when Python drops them, and each node that rebuilds a
tensor in backward holds a temporary of its size while it runs. The simulator scores that
profile like any other, so the solver's rows for a variant come from the same place as its
rows for a segment.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from monet_cli.core.profile import PackRecord, Profile, StorageRecord, VariantSite

BATCH_NORM_OPS = frozenset({
    "aten.native_batch_norm.default", "aten._native_batch_norm_legit.default", "aten.cudnn_batch_norm.default",
    "aten.miopen_batch_norm.default",
})
ACTIVATION_OPS = {"aten.relu.default": ("ReLU",), "aten.hardtanh.default": ("ReLU6", "Hardtanh")}
CONV_OPS = frozenset({"aten.convolution.default"})
CONV_TYPES = ("Conv1d", "Conv2d", "Conv3d")

MIN_BN_WEIGHT = 1e-3
"""A BatchNorm whose weight has an entry smaller than this in magnitude is not offered the
variant, and falls back to keeping its input when applied: rebuilding the input divides by
the weight."""

TOLERANCE = {"bn_output": (1e-3, 1e-4)}
"""(rtol, atol) a schedule states for each variant: its gradients are not bit-identical (the
BatchNorm's input is rebuilt from its output, rounding differently). Each gradient and
updated parameter element must be within rtol of the unmodified model's value plus atol
times the model's largest gradient magnitude (a gradient that is zero in exact arithmetic,
such as a bias before a BatchNorm, is rounding noise: no relative bound holds for it).
Measured on resnet50 and mobilenet_v2 with every variant on: largest difference 4.6e-6
and 1.1e-6 of the largest gradient (docs/benchmarks.md)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SiteStorages:
    bn_input: int
    bn_output: int
    activation_output: int
    bn_call: int
    activation_call: int
    conv_calls: tuple[int, ...]


def innermost_calls(profile: Profile) -> list[int | None]:
    """For each forward op, the innermost module call running it."""
    owner: list[int | None] = [None] * len(profile.ops)
    for call in profile.calls:  # parents come before their children
        for op in range(call.first_op, call.end_op):
            owner[op] = call.index
    return owner


def find_sites(profile: Profile) -> list[VariantSite]:
    """Every place the variant applies, by the profile's ops, calls, storages and packs."""
    if profile.model.precision != "32":
        return []  # under autocast the BatchNorm sees a cast input: not offered yet
    owner = innermost_calls(profile)
    sites = []
    for op in profile.ops:
        storages = _site_storages(profile, owner, op.index)
        if storages is not None:
            act = profile.ops[op.index].consumers[0]
            convs = profile.ops[act].consumers
            calls = profile.calls
            sites.append(VariantSite(
                bn=op.index, activation=act, convs=convs, bn_module=calls[storages.bn_call].fqn,
                activation_module=calls[storages.activation_call].fqn,
                conv_modules=tuple(calls[c].fqn for c in storages.conv_calls),
            ))
    return sites


def _site_storages(profile: Profile, owner: list[int | None], bn: int) -> SiteStorages | None:
    """The storages and calls of a site at BatchNorm op ``bn``, or None if it is no site."""
    ops, calls = profile.ops, profile.calls
    if ops[bn].op not in BATCH_NORM_OPS or len(ops[bn].consumers) != 1 or len(ops[bn].inputs) != 1:
        return None
    act = ops[bn].consumers[0]
    types = ACTIVATION_OPS.get(ops[act].op, ())
    convs = ops[act].consumers
    if not convs or any(ops[k].op not in CONV_OPS for k in convs) or ops[ops[bn].inputs[0]].consumers != (bn,):
        return None
    if any(ops[k].inplace_of is not None for k in (bn, act, *convs)):
        return None
    bn_call, act_call = owner[bn], owner[act]
    conv_calls = tuple(owner[k] for k in convs)
    if bn_call is None or act_call is None or None in conv_calls:
        return None
    if "BatchNorm" not in calls[bn_call].type or calls[act_call].type not in types \
            or any(calls[c].type not in CONV_TYPES for c in conv_calls):
        return None
    once = _called_once(profile)
    if not all(once[calls[c].fqn] for c in (bn_call, *conv_calls)):
        return None
    c, y, r = _largest_output(profile, ops[bn].inputs[0]), _largest_output(profile, bn), _largest_output(profile, act)
    if None in (c, y, r) or any(profile.storages[s].mutated for s in (c, y, r)):
        return None
    by_storage = _pack_calls(profile)
    if not by_storage.get(c, set()) <= {bn_call} or not by_storage.get(y, set()) <= {act_call} \
            or not by_storage.get(r, set()) <= {act_call, *conv_calls}:
        return None
    return SiteStorages(bn_input=c, bn_output=y, activation_output=r, bn_call=bn_call, activation_call=act_call,
                        conv_calls=conv_calls)  # type: ignore[arg-type]


def _called_once(profile: Profile) -> dict[str, bool]:
    counts: dict[str, int] = {}
    for call in profile.calls:
        counts[call.fqn] = counts.get(call.fqn, 0) + 1
    return {fqn: n == 1 for fqn, n in counts.items()}


def _largest_output(profile: Profile, op: int) -> int | None:
    made = [s for s in profile.storages if s.producer == op and s.kind == "activation"]
    return max(made, key=lambda s: s.bytes).id if made else None


def _pack_calls(profile: Profile) -> dict[int, set[int | None]]:
    calls: dict[int, set[int | None]] = {}
    for pack in profile.packs:
        calls.setdefault(pack.storage, set()).add(pack.call)
    return calls


def site_storages(profile: Profile, site: VariantSite) -> SiteStorages:
    found = _site_storages(profile, innermost_calls(profile), site.bn)
    if found is None:
        raise ValueError(f"op {site.bn} ({site.bn_module}) is no variant site of this profile")
    return found


def with_variants(profile: Profile, chosen: Iterable[int]) -> Profile:
    """``profile`` as if the variants ``chosen`` (indices into ``profile.variants``) had run."""
    packs = list(profile.packs)
    storages = list(profile.storages)
    for index in sorted(set(chosen)):
        at = site_storages(profile, profile.variants[index])
        _rewrite_site(at, packs, storages)
    return replace(profile, packs=tuple(packs), storages=tuple(storages))


def _rewrite_site(at: SiteStorages, packs: list[PackRecord], storages: list[StorageRecord]) -> None:
    c, y, r = at.bn_input, at.bn_output, at.activation_output
    rebuilt = {at.bn_call: c, **dict.fromkeys(at.conv_calls, r)}
    """Nodes that rebuild a tensor in backward, and which one."""
    for k, pack in enumerate(packs):
        moved = (pack.storage == c and pack.call == at.bn_call) or (
            pack.storage == r and pack.call in (at.activation_call, *at.conv_calls))
        if not moved:
            continue
        packs[k] = replace(pack, storage=y)
        if pack.call in rebuilt and pack.unpack is not None and pack.release is not None:
            storages.append(StorageRecord(id=len(storages), bytes=storages[rebuilt[pack.call]].bytes, kind="temp",
                                          producer=None, alloc=pack.unpack, free=pack.release))
            rebuilt.pop(pack.call)  # one temporary per node
    for sid in (c, r, y):
        storages[sid] = replace(storages[sid], free=_free_when_saved(storages[sid], packs))


def _free_when_saved(storage: StorageRecord, packs: list[PackRecord]) -> int | None:
    """When ``storage`` dies: when Python drops it, or when the last node saving it releases it."""
    ends = [p.release for p in packs if p.storage == storage.id]
    dropped = storage.free_no_autograd if storage.free_no_autograd is not None else storage.free
    if dropped is None or None in ends:
        return None
    return max([dropped, *ends])  # type: ignore[type-var]
