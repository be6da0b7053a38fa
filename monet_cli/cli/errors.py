"""Turn ``MonetError``s into one line on stderr and their exit code."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

import typer

from monet_cli.errors import MonetError

EXIT_INTERRUPTED = 130


@contextmanager
def user_errors() -> Iterator[None]:
    """Wrap a command body: user mistakes never show a traceback."""
    try:
        yield
    except MonetError as err:
        print(f"monet: error: {err}", file=sys.stderr)
        raise typer.Exit(code=err.exit_code) from None
    except KeyboardInterrupt:
        print("monet: interrupted", file=sys.stderr)
        raise typer.Exit(code=EXIT_INTERRUPTED) from None
