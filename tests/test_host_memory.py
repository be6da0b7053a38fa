"""glibc's malloc kept from handing freed memory back: steps timed without page faults."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

_STEP_FAULTS = """
import resource, statistics, sys, torch
from torch import nn
from monet_cli.runtime.host_memory import keep_freed_host_memory
took = keep_freed_host_memory() if sys.argv[1] == "kept" else False
model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))
x = torch.randn(10240, 256)  # activations of 40 MiB: more than glibc ever serves from its heap by itself
def step():
    model.zero_grad()
    model(x).square().mean().backward()
for _ in range(3):
    step()
faults = []
for _ in range(7):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(took, min(faults), statistics.median(faults))
"""


def _faults_per_step(mode: str) -> tuple[bool, int, float]:
    """Whether malloc took the setting, and the fewest and the median minor faults of 7 steps."""
    out = subprocess.run([sys.executable, "-c", _STEP_FAULTS, mode], capture_output=True, text=True, check=True)
    took, fewest, median = out.stdout.split()
    return took == "True", int(fewest), float(median)


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_freed_host_memory_is_kept_so_steps_fault_no_page_in_again():
    """By default each 40 MiB activation is mapped afresh every step and its 10,240 pages
    fault in; kept, most steps fault none (now and then one takes a fresh block while the
    heap settles)."""
    took, fewest, _ = _faults_per_step("default")
    assert not took and fewest > 10_240
    took, _, median = _faults_per_step("kept")
    assert took and median < 100
