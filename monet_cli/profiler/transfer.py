"""How fast copies between device memory and pinned host memory run, measured on the target
device: what an offload costs (``monet_cli/core/offload.py``).

Copies of a few sizes each way, timed with CUDA events, medians of several; a line through
them gives the fixed cost of one copy and the bytes per millisecond. Only a CUDA device has
host memory apart from its own; on a CPU there is nothing to measure.
"""

from __future__ import annotations

import functools
import statistics

import torch

from monet_cli.core.profile import Transfer

SIZES = (1 << 20, 8 << 20, 64 << 20)
REPEATS = 5


def _copy_ms(destination: torch.Tensor, source: torch.Tensor) -> float:
    times = []
    for _ in range(REPEATS + 1):  # the first copy warms up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        destination.copy_(source, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[1:])


def _line(sizes: tuple[int, ...], times: list[float]) -> tuple[float, float]:
    """Least-squares (intercept ms, bytes per ms) of ``times`` against ``sizes``."""
    mean_n, mean_t = statistics.fmean(sizes), statistics.fmean(times)
    slope = sum((n - mean_n) * (t - mean_t) for n, t in zip(sizes, times)) / sum((n - mean_n) ** 2 for n in sizes)
    return mean_t - slope * mean_n, 1.0 / max(slope, 1e-12)


@functools.cache  # a property of the machine, not of the model: measured once per process
def measure_transfer(device: torch.device) -> Transfer | None:
    if device.type != "cuda":
        return None
    to_host, to_device = [], []
    for nbytes in SIZES:
        on_device = torch.empty(nbytes, dtype=torch.uint8, device=device)
        on_host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        to_host.append(_copy_ms(on_host, on_device))
        to_device.append(_copy_ms(on_device, on_host))
        del on_device
    torch.cuda.empty_cache()
    host_fixed, host_rate = _line(SIZES, to_host)
    device_fixed, device_rate = _line(SIZES, to_device)
    return Transfer(
        fixed_ms=round(max(0.0, (host_fixed + device_fixed) / 2), 5),
        to_host_bytes_per_ms=round(host_rate),
        to_device_bytes_per_ms=round(device_rate),
    )
