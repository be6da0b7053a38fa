"""Did other processes share this machine's CPUs while monet timed steps on them?

A CPU profile's times, and every overhead predicted from them, assume the step has the
machine to itself. On this project's 2-core CPU a timm vit_tiny step profiled beside a test
run took 732 ms against 243 ms quiet, and the profile predicted +3.6% for a schedule that then
measured +18% (12-05). Its last plain steps ran as slowly as its first, so the warning on a
change of speed did not fire. So the profile counts the CPU time all processes used while
it ran (Linux ``/proc/stat``) less its own (``os.times``, every thread of it): what is left
is other processes' work. ``monet apply`` does the same around the pairs it times.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass

import torch

SPARE_CPUS = 0.5
"""Other processes may keep this many CPUs busy on average beyond those torch's threads leave
free before monet warns: a daemon's wake-ups stay under it, a second busy process does not."""

MIN_WINDOW_S = 1.0
"""Both clocks count whole ticks (10 ms on Linux): over the 4 to 360 ms in which the suite's
``apply`` runs time their pairs, with no other process running, the reading said 0 to 2.3
CPUs of other work. Shorter windows than this are not judged."""

_STAT = "/proc/stat"


@dataclass(frozen=True, kw_only=True, slots=True)
class CpuTimes:
    """A reading of the clocks, in seconds."""

    wall_s: float
    busy_s: float
    """CPU time used since boot on the CPUs this process may run on, idle and I/O wait
    excluded (time the hypervisor gave another machine included: it slows the step as much)."""
    own_s: float
    """CPU time this process used (user and system, all its threads)."""


def read_cpu_times() -> CpuTimes | None:
    """Now's reading, over the CPUs this process may run on (its affinity: a container's
    cpuset, say); None where ``/proc/stat`` cannot be read (not Linux)."""
    allowed = usable_cpus()
    busy_ticks = 0
    try:
        with open(_STAT) as stat:
            for line in stat:
                name, *ticks = line.split()
                if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in allowed:
                    # user to steal (guest time is in user already), less idle and I/O wait
                    busy_ticks += sum(int(t) for t in ticks[:8]) - int(ticks[3]) - int(ticks[4])
    except (OSError, ValueError, IndexError):
        return None
    own = os.times()
    return CpuTimes(wall_s=time.monotonic(), busy_s=busy_ticks / os.sysconf("SC_CLK_TCK"), own_s=own.user + own.system)


def usable_cpus() -> set[int]:
    """The CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def others_busy_cpus(start: CpuTimes, end: CpuTimes) -> float:
    """CPUs other processes kept busy on average between two readings (``end`` later)."""
    return max(0.0, (end.busy_s - start.busy_s) - (end.own_s - start.own_s)) / (end.wall_s - start.wall_s)


def others_busy_since(start: CpuTimes | None) -> float | None:
    """CPUs other processes kept busy on average since ``start``, to 0.001 (the clocks count
    10 ms ticks); None where the readings cannot be taken or lie less than ``MIN_WINDOW_S`` apart."""
    end = read_cpu_times()
    if start is None or end is None or end.wall_s - start.wall_s < MIN_WINDOW_S:
        return None
    return round(others_busy_cpus(start, end), 3)


def warn_if_shared(busy: float | None, timed: str, consequence: str) -> None:
    """Warn when other work kept ``busy`` CPUs busy (``others_busy_since``), more than
    ``SPARE_CPUS`` beyond those torch's threads leave free; nothing where it was not read:
    "other work kept ... busy while {timed}; {consequence}"."""
    cpus, threads = len(usable_cpus()), torch.get_num_threads()
    if busy is not None and busy > max(0, cpus - threads) + SPARE_CPUS:
        warnings.warn(
            f"monet: other work kept {busy:.1f} of the {cpus} CPUs monet may run on busy while {timed} "
            f"(torch runs {threads} threads); {consequence}",
            stacklevel=2,
        )
