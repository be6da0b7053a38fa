"""Turn ``MonetError``s into one line on stderr and their exit code, and monet's warnings into
one line on stderr."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

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


def show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    """``warnings.showwarning`` for the command line: monet's own warnings (their text starts
    with ``monet: ``) as one line, ``monet: warning: ...``, without the Python source line
    that raised them; any other library's as Python shows it."""
    text = str(message)
    shown = (
        f"monet: warning: {text.removeprefix('monet: ')}\n"
        if text.startswith("monet: ")
        else warnings.formatwarning(message, category, filename, lineno, line)
    )
    (file or sys.stderr).write(shown)
