"""Measure each operator variant where it applies: the bytes it keeps, the time it costs.

Each site (a BatchNorm, its activation and the convolutions after it; a max-pooling) runs
alone on copies of its modules, at the shapes of the profiled step, on the profiled device: once as PyTorch
runs it and once as the variant, forward and backward, interleaved, timed by medians. The
tensors autograd keeps are counted with saved-tensor hooks (each storage once, parameters
apart). Nothing is taken from a formula: the simulator's rewrite of the profile says where
the kept bytes live, and these numbers say what a variant keeps and costs.
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

from monet_cli.core.profile import VariantRecord, VariantSite
from monet_cli.runtime.meter import storage_key
from monet_cli.runtime.variants import install_on, offset_dtype, variant_ready
from monet_cli.workload.step import Workload

REPEATS = 5
"""Timed runs of each version per site, after one warm-up run of each."""


def measure_variants(workload: Workload, sites: list[VariantSite]) -> tuple[VariantRecord, ...]:
    """A record for every site whose modules can run the variant now (a BatchNorm weight near
    zero, or a module of another kind than the profile saw, leaves the site out)."""
    ready = [site for site in sites if not variant_ready(workload.model, site)]
    if not ready:
        return ()
    shapes = _input_shapes(workload, [site.module for site in ready])
    modules = dict(workload.model.named_modules())
    records = []
    for site in ready:
        if site.impl == "maxpool_offsets" and offset_dtype(modules[site.module], shapes[site.module][-1]) is None:
            continue  # rows too wide for an int16 offset
        native = _SiteModules(site, modules)
        variant = _SiteModules(site, modules)
        variant.install()
        x = torch.randn(shapes[site.module], device=workload.device, dtype=torch.float32)
        native_bytes, variant_bytes = native.saved_bytes(x), variant.saved_bytes(x)
        native_ms, variant_ms = _interleaved_ms(native.run, variant.run, x, workload)
        records.append(
            VariantRecord(
                **site.site(),
                time_ms=round(variant_ms - native_ms, 4),
                saved_bytes=variant_bytes,
                native_saved_bytes=native_bytes,
            )
        )
    return tuple(records)


class _SiteModules:
    """Copies of one site's modules, run as the model runs them."""

    def __init__(self, site: VariantSite, modules: dict[str, nn.Module]) -> None:
        self.roles = [(role, copy.deepcopy(modules[path])) for role, path in site.roles()]

    def install(self) -> None:
        for role, module in self.roles:
            install_on(role, module)

    def run(self, x: torch.Tensor) -> None:
        self.forward(x).backward()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The first module on ``x``, the second on its output, the rest on the second's (a
        BatchNorm, its activation, the convolutions after it; or a pooling alone)."""
        modules = [module for _, module in self.roles]
        y = modules[0](x.requires_grad_())
        if len(modules) > 1:
            y = modules[1](y)
        if len(modules) > 2:
            return sum(conv(y).sum() for conv in modules[2:])  # type: ignore[return-value]
        return y.sum()

    def saved_bytes(self, x: torch.Tensor) -> int:
        """Bytes of the activations autograd keeps for this site's backward."""
        params = {storage_key(t) for _, m in self.roles for t in (*m.parameters(), *m.buffers())}
        kept: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            key = storage_key(tensor)
            if key not in params:
                kept[key] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = self.forward(x.detach().clone())
        del out
        return sum(kept.values())


def _input_shapes(workload: Workload, paths: list[str]) -> dict[str, torch.Size]:
    """The input shape of each module in ``paths``, from ``Workload.observe_forward``."""
    shapes: dict[str, torch.Size] = {}
    modules = dict(workload.model.named_modules())
    handles = [modules[path].register_forward_pre_hook(_shape_hook(shapes, path)) for path in paths]
    try:
        workload.observe_forward()
    finally:
        for handle in handles:
            handle.remove()
    return shapes


def _shape_hook(shapes: dict[str, torch.Size], path: str) -> Callable:
    def hook(module: nn.Module, args: tuple) -> None:
        shapes[path] = args[0].shape

    return hook


def _interleaved_ms(
    native: Callable[[torch.Tensor], None], variant: Callable[[torch.Tensor], None], x: torch.Tensor, workload: Workload
) -> tuple[float, float]:
    """Median milliseconds of each, run alternately after one warm-up run each."""
    times: dict[int, list[float]] = {0: [], 1: []}
    for repeat in range(REPEATS + 1):
        for which, run in enumerate((native, variant)):
            fresh = x.detach().clone()
            workload.sync()
            start = time.perf_counter()
            run(fresh)
            workload.sync()
            if repeat:
                times[which].append((time.perf_counter() - start) * 1000)
    return statistics.median(times[0]), statistics.median(times[1])
