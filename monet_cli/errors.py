"""Errors a user can cause, each with its own exit code.

The CLI turns a ``MonetError`` into one line on stderr and ``raise SystemExit(code)``;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

# One table, shown in --help and the README. Codes 2-7 follow the conventions note;
# 8-10 name failures that are the user's environment or model rather than their flags.
EXIT_OK = 0
EXIT_UNEXPECTED = 1
EXIT_USAGE = 2
EXIT_INFEASIBLE = 3
EXIT_NO_SOLUTION = 4
EXIT_FINGERPRINT = 5
EXIT_BAD_FILE = 6
EXIT_OVER_BUDGET = 7
EXIT_MODEL_FAILED = 8
EXIT_DEVICE = 9
EXIT_OUTPUT = 10

EXIT_CODE_TABLE: tuple[tuple[int, str], ...] = (
    (EXIT_OK, "success"),
    (EXIT_UNEXPECTED, "unexpected internal error (a bug: please report it)"),
    (EXIT_USAGE, "bad command line or bad input (unknown model, bad shape, bad budget)"),
    (EXIT_INFEASIBLE, "the budget is below the smallest peak any schedule can reach"),
    (EXIT_NO_SOLUTION, "the solver found no schedule within its time limit"),
    (EXIT_FINGERPRINT, "schedule or profile does not match the model (fingerprint), or the model already checkpoints"),
    (EXIT_BAD_FILE, "unsupported or corrupt profile/schedule file"),
    (EXIT_OVER_BUDGET, "measured peak above the budget, or gradients differ"),
    (EXIT_MODEL_FAILED, "the model raised an error while running"),
    (EXIT_DEVICE, "the requested device is not available"),
    (EXIT_OUTPUT, "the output file cannot be written"),
)


class MonetError(Exception):
    """A failure the user can act on; ``str(err)`` is the one line we print."""

    exit_code = EXIT_UNEXPECTED


class UsageError(MonetError):
    exit_code = EXIT_USAGE


class InfeasibleError(MonetError):
    exit_code = EXIT_INFEASIBLE


class NoSolutionError(MonetError):
    exit_code = EXIT_NO_SOLUTION


class FingerprintError(MonetError):
    exit_code = EXIT_FINGERPRINT


class CheckpointConflictError(FingerprintError):
    """The model already checkpoints (Hugging Face, timm or torch wrappers): two planners would fight."""


class FileFormatError(MonetError):
    exit_code = EXIT_BAD_FILE


class OverBudgetError(MonetError):
    exit_code = EXIT_OVER_BUDGET


class ModelError(MonetError):
    exit_code = EXIT_MODEL_FAILED


class DeviceError(MonetError):
    exit_code = EXIT_DEVICE


class OutputError(MonetError):
    exit_code = EXIT_OUTPUT
