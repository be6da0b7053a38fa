"""Byte sizes and memory budgets: parsing what users type, formatting what we print.

Everything here is exact: numbers are parsed with ``fractions.Fraction`` straight from
the text, so ``1.5G`` is exactly 1610612736 bytes and never goes through a float.
"""

from __future__ import annotations

import re
from fractions import Fraction

from monet_cli.errors import UsageError

# Binary units are the default for single letters because that is what nvidia-smi and
# PyTorch report, so "8G" means what the user sees there; the "xB" spellings are SI.
_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 2**10,
    "kib": 2**10,
    "m": 2**20,
    "mib": 2**20,
    "g": 2**30,
    "gib": 2**30,
    "t": 2**40,
    "tib": 2**40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}

_UNIT_HINT = "B, K/KiB, M/MiB, G/GiB, T/TiB, KB, MB, GB or TB"
_BUDGET_UNIT_HINT = "B, K/KiB, M/MiB, G/GiB, T/TiB, KB, MB, GB, TB or a percentage like 60%"

# [0-9] rather than \d: \d also matches non-ASCII digits, which we do not want to accept.
# The number needs a digit on both sides of the point, so "8.", ".5" and "8..G" fail.
# Only spaces and tabs may separate number and unit: "8\nG" is more likely a mistake.
_SIZE_RE = re.compile(r"(?P<num>[0-9]+(?:\.[0-9]+)?)[ \t]*(?P<unit>[a-z%]*)", re.IGNORECASE)

# Scientific notation is rejected on purpose: "1e9" reads like a unit ("e" could be
# taken for exa) and invites float-style values; the units say the same thing clearly.
_SCIENTIFIC_RE = re.compile(r"[0-9.]+e[+-]?[0-9]+[ \t]*[a-z%]*", re.IGNORECASE)

# A budget of more than ten times the baseline peak is almost surely a typo.
_MAX_PERCENT = 1000

_IEC_UNITS: tuple[str, ...] = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


def _fail(label: str, text: str, reason: str) -> UsageError:
    # repr() quotes the text and escapes newlines, so the message stays one line.
    return UsageError(f"{label} {text!r}: {reason}")


def _split(text: str, label: str, unit_hint: str) -> tuple[Fraction, str]:
    """Split ``text`` into an exact positive number and its unit as typed."""
    stripped = text.strip()
    if not stripped:
        raise _fail(label, text, f"empty; give a size like 8G or 512MiB (units: {unit_hint})")
    if stripped.startswith("-"):
        raise _fail(label, text, "must be positive")
    if _SCIENTIFIC_RE.fullmatch(stripped):
        raise _fail(label, text, "scientific notation is not accepted; use a unit, like 1GB")
    match = _SIZE_RE.fullmatch(stripped)
    if match is None:
        reason = f"expected a number and an optional unit, like 8G or 1.5GB (units: {unit_hint})"
        raise _fail(label, text, reason)
    number = Fraction(match["num"])
    if number == 0:
        raise _fail(label, text, "must be greater than zero")
    return number, match["unit"]


def _scale(number: Fraction, unit: str, text: str, label: str, unit_hint: str) -> int:
    """Turn ``number`` in ``unit`` into a positive whole number of bytes (rounded down)."""
    # Look up case-insensitively but echo the unit as the user typed it.
    factor = _UNITS.get(unit.lower())
    if factor is None:
        raise _fail(label, text, f"unknown unit {unit!r} (use {unit_hint})")
    size = int(number * factor)  # int() of a positive Fraction rounds down
    if size <= 0:
        raise _fail(label, text, "is less than one byte")
    return size


def parse_size(text: str) -> int:
    """Parse a byte size such as ``8G``, ``512MiB``, ``1.5GB`` or ``8589934592``.

    Single letters and ``KiB``..``TiB`` are binary (``8G`` == 8 * 2**30); ``KB``..``TB``
    are SI powers of ten; no unit or ``B`` means bytes. Case and spaces between the
    number and the unit do not matter. Fractional bytes are rounded down.

    Raises ``UsageError`` for empty, zero, negative or malformed text and unknown units.
    """
    number, unit = _split(text, "size", _UNIT_HINT)
    if unit == "%":
        raise _fail("size", text, "a percentage is not a size here; give bytes like 8G")
    return _scale(number, unit, text, "size", _UNIT_HINT)


def parse_budget(text: str, *, baseline_peak_bytes: int | None) -> int:
    """Parse a memory budget: a size (see ``parse_size``) or a percentage like ``60%``.

    A percentage is taken of ``baseline_peak_bytes`` (the profiled peak without any
    schedule) and rounded down to whole bytes; it must lie in (0%, 1000%].

    Raises ``UsageError`` for anything ``parse_size`` rejects, a percentage with no
    baseline, a percentage out of range, or a budget that comes to zero bytes.
    """
    number, unit = _split(text, "budget", _BUDGET_UNIT_HINT)
    if unit != "%":
        return _scale(number, unit, text, "budget", _BUDGET_UNIT_HINT)
    if number > _MAX_PERCENT:
        raise _fail("budget", text, f"percentages above {_MAX_PERCENT}% are not accepted")
    if baseline_peak_bytes is None:
        reason = "a percentage needs a baseline peak (profile the model first) or bytes like 8G"
        raise _fail("budget", text, reason)
    if baseline_peak_bytes <= 0:
        # The baseline comes from our own profiler, so a non-positive one is a bug.
        raise ValueError(f"baseline_peak_bytes must be positive, got {baseline_peak_bytes}")
    budget = int(number * baseline_peak_bytes / 100)  # exact, rounded down
    if budget <= 0:
        baseline = describe_bytes(baseline_peak_bytes)
        raise _fail("budget", text, f"comes to 0 bytes of the baseline peak {baseline}")
    return budget


def format_bytes(n: int) -> str:
    """Format a byte count with IEC units: ``0 B``, ``512 B``, ``1.50 MiB``, ``-8.00 GiB``.

    Uses the largest unit in which the value is at least 1, with two decimals (plain
    bytes have none). A value that would round up to ``1024.00`` is shown in the next
    unit instead, so 1048575 reads ``1.00 MiB`` rather than ``1024.00 KiB``.
    """
    if n < 0:
        return "-" + format_bytes(-n)
    if n < 1024:
        return f"{n} B"
    for power, unit in enumerate(_IEC_UNITS[1:], start=1):
        # Fraction keeps huge counts exact; float is only used for the final rounding.
        shown = f"{float(Fraction(n, 1024**power)):.2f}"
        if float(shown) < 1024 or unit == _IEC_UNITS[-1]:
            return f"{shown} {unit}"
    raise AssertionError("unreachable")  # the last unit always returns


def describe_bytes(n: int) -> str:
    """Format a byte count with its exact value, e.g. ``8.00 GiB (8589934592 bytes)``."""
    noun = "byte" if abs(n) == 1 else "bytes"
    return f"{format_bytes(n)} ({n} {noun})"
