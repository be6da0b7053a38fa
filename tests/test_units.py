"""Tests for monet_cli.core.units: the size/budget grammar and byte formatting."""

from __future__ import annotations

import pytest

from monet_cli.core.units import describe_bytes, format_bytes, parse_budget, parse_size
from monet_cli.errors import UsageError

GiB = 2**30


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8G", 8 * GiB),
        ("8g", 8 * GiB),
        ("8GiB", 8 * GiB),
        ("8gib", 8 * GiB),
        ("8 GiB", 8 * GiB),
        ("  8G  ", 8 * GiB),
        ("8GB", 8 * 10**9),
        ("8gb", 8 * 10**9),
        ("512MiB", 512 * 2**20),
        ("500M", 500 * 2**20),
        ("500MB", 500 * 10**6),
        ("4K", 4 * 2**10),
        ("4KiB", 4 * 2**10),
        ("4KB", 4000),
        ("2T", 2 * 2**40),
        ("1.5TiB", 3 * 2**39),
        ("1TB", 10**12),
        ("1.5G", 1610612736),  # exact: 3 * 2**29, no float rounding
        ("0.1GB", 10**8),  # 0.1 has no exact float; Fraction keeps it exact
        ("8589934592", 8 * GiB),
        ("100B", 100),
        ("100b", 100),
        ("512B", 512),
        ("1.5", 1),  # fractional bytes round down
        ("1.9B", 1),
        ("1.0000000001K", 1024),  # 1024.0000001 bytes rounds down
    ],
)
def test_parse_size_grammar(text: str, expected: int) -> None:
    assert parse_size(text) == expected
    # Every size is also a valid budget, with or without a baseline.
    assert parse_budget(text, baseline_peak_bytes=None) == expected
    assert parse_budget(text, baseline_peak_bytes=1000) == expected


@pytest.mark.parametrize(
    ("text", "baseline", "expected"),
    [
        ("60%", 1000, 600),
        ("60.5%", 1000, 605),
        ("33.3%", 1000, 333),
        ("33.33%", 1000, 333),  # 333.3 rounds down
        ("99.99%", 1000, 999),  # 999.9 rounds down, not up to 1000
        ("100%", 8 * GiB, 8 * GiB),
        ("50 %", 8 * GiB, 4 * GiB),
        ("1000%", 10, 100),
        ("1%", 8589934593, 85899345),  # exact integer maths on a large baseline
    ],
)
def test_parse_budget_percentages(text: str, baseline: int, expected: int) -> None:
    assert parse_budget(text, baseline_peak_bytes=baseline) == expected


def _assert_usage_error(exc: pytest.ExceptionInfo[UsageError], text: str) -> None:
    message = str(exc.value)
    assert repr(text) in message
    assert "\n" not in message
    assert message.strip() == message and message


SIZE_ERRORS = [
    "",
    "   ",
    "0",
    "0G",
    "0.0GiB",
    "-1G",
    "-1",
    "abc",
    "8XB",
    "G",
    "G8",
    "8..G",
    "8.G",
    ".5G",
    "8 G B",
    "1,5G",
    "8GiBs",
    # Scientific notation is rejected on purpose: "1e9" looks like a unit (exa?) and
    # invites float-style values; "1GB" or "1000000000" say the same without doubt.
    "1e9",
    "1E9",
    "1.5e3K",
    "nan",
    "NaN",
    "inf",
    "-inf",
    "Infinity",
    "0.5B",  # rounds down to zero bytes
    "8\nG",  # only spaces/tabs separate number and unit; the message stays one line
    "8\tXB\n\n",
    "\u0668G",  # Arabic-Indic digit eight: only ASCII digits are accepted
]


@pytest.mark.parametrize("text", SIZE_ERRORS)
def test_parse_size_errors(text: str) -> None:
    with pytest.raises(UsageError) as exc:
        parse_size(text)
    _assert_usage_error(exc, text)


BUDGET_ONLY_ERRORS = ["-5%", "0%", "0.0%", "1001%", "1000.5%", "%", "60%%"]


@pytest.mark.parametrize("text", [*SIZE_ERRORS, *BUDGET_ONLY_ERRORS])
def test_parse_budget_errors(text: str) -> None:
    with pytest.raises(UsageError) as exc:
        parse_budget(text, baseline_peak_bytes=1000)
    _assert_usage_error(exc, text)


def test_percentage_needs_baseline() -> None:
    with pytest.raises(UsageError, match="baseline") as exc:
        parse_budget("60%", baseline_peak_bytes=None)
    _assert_usage_error(exc, "60%")


def test_percentage_that_rounds_to_zero_bytes_is_an_error() -> None:
    with pytest.raises(UsageError) as exc:
        parse_budget("0.01%", baseline_peak_bytes=100)
    _assert_usage_error(exc, "0.01%")


def test_parse_size_rejects_percentages() -> None:
    with pytest.raises(UsageError, match="percentage") as exc:
        parse_size("60%")
    _assert_usage_error(exc, "60%")


def test_unknown_unit_message() -> None:
    with pytest.raises(UsageError) as exc:
        parse_budget("8XB", baseline_peak_bytes=None)
    assert str(exc.value) == (
        "budget '8XB': unknown unit 'XB' (use B, K/KiB, M/MiB, G/GiB, T/TiB, KB, MB, GB, TB or a percentage like 60%)"
    )


def test_unknown_unit_hint_for_sizes_omits_percentages() -> None:
    with pytest.raises(UsageError) as exc:
        parse_size("8XB")
    assert "%" not in str(exc.value)


def test_non_positive_baseline_is_a_bug_not_a_usage_error() -> None:
    with pytest.raises(ValueError):
        parse_budget("60%", baseline_peak_bytes=0)


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (0, "0 B"),
        (1, "1 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (3 * 2**19, "1.50 MiB"),
        (2**20 - 1, "1.00 MiB"),  # would be "1024.00 KiB": shown in the next unit
        (8 * GiB, "8.00 GiB"),
        (1610612736, "1.50 GiB"),
        (3 * 2**39, "1.50 TiB"),
        (2**50, "1.00 PiB"),
        (2**60, "1.00 EiB"),
        (2**70, "1024.00 EiB"),  # nothing larger: stays in the last unit
        (-1024, "-1.00 KiB"),
        (-(2**20), "-1.00 MiB"),
        (-512, "-512 B"),
    ],
)
def test_format_bytes(n: int, expected: str) -> None:
    assert format_bytes(n) == expected


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (8 * GiB, "8.00 GiB (8589934592 bytes)"),
        (512, "512 B (512 bytes)"),
        (1, "1 B (1 byte)"),
        (0, "0 B (0 bytes)"),
    ],
)
def test_describe_bytes(n: int, expected: str) -> None:
    assert describe_bytes(n) == expected


def test_round_trip_through_describe() -> None:
    budget = parse_budget("60%", baseline_peak_bytes=8 * GiB)
    assert describe_bytes(budget) == f"4.80 GiB ({budget} bytes)"


def test_core_imports_no_torch_typer_or_rich():
    """The pure core must load without torch, typer or rich (checked in a fresh interpreter)."""
    import subprocess
    import sys

    code = (
        "import sys, pkgutil, importlib, monet_cli.core as c\n"
        "for m in pkgutil.walk_packages(c.__path__, 'monet_cli.core.'): importlib.import_module(m.name)\n"
        "bad = [n for n in ('torch', 'typer', 'rich') if n in sys.modules]\n"
        "print(bad); sys.exit(1 if bad else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_torch_below_the_tested_floor_is_run_with_a_warning(monkeypatch):
    import warnings

    from monet_cli.runtime import fingerprint

    monkeypatch.setattr(fingerprint, "torch_version", lambda: "2.9.1")
    with pytest.warns(UserWarning, match="torch 2.9.1 is older than 2.11"):
        fingerprint.warn_if_untested_torch()
    monkeypatch.setattr(fingerprint, "torch_version", lambda: "2.11.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fingerprint.warn_if_untested_torch()


def test_the_median_s_interval_is_the_sign_test_s():
    """21 values: the 7th smallest to the 7th largest (P(Binomial(21, 1/2) < 7) = 0.039, so
    at least 92% hold the median); 41 values: the 15th to the 27th; 3 values: the extremes
    (they hold the median with 75%, the most three values can). Over many normal samples the
    interval holds the true median about as often as it says."""
    import random

    from monet_cli.core.stats import median_interval

    assert median_interval([float(v) for v in reversed(range(1, 22))], 0.9) == (7.0, 15.0)
    assert median_interval([float(v) for v in range(1, 42)], 0.9) == (15.0, 27.0)
    assert median_interval([3.0, 1.0, 2.0], 0.9) == (1.0, 3.0)
    with pytest.raises(ValueError):
        median_interval([], 0.9)
    rng = random.Random(1)
    samples = [[rng.gauss(0.0, 1.0) for _ in range(21)] for _ in range(2000)]
    held = sum(low <= 0.0 <= high for low, high in (median_interval(s, 0.9) for s in samples)) / len(samples)
    assert 0.90 <= held <= 0.95
