"""How the CLI reports an error: one line on stderr, whatever the terminal width.

A message is printed as given, with any line breaks inside it folded into spaces, and with rich
markup escaped (a path like `runs/[red]/trace` is printed as is). No wrapping: a log scraper or a
user's grep sees the whole error on one line.
"""

from __future__ import annotations

import sys
from typing import TextIO


def one_line(message: str) -> str:
    """`message` with every run of whitespace that holds a line break folded into one space."""
    return " ".join(part.strip() for part in message.splitlines() if part.strip())


def print_error(message: str, *, label: str = "error", file: TextIO | None = None) -> None:
    """Print `label: message` as one red-labelled line on `file` (stderr by default)."""
    # rich is imported when an error is printed, like everywhere in the CLI: `kvstrata
    # version` and `--help` stay fast.
    from rich.console import Console
    from rich.markup import escape

    console = Console(file=file if file is not None else sys.stderr, soft_wrap=True)
    console.print(f"[red]{escape(label)}:[/] {escape(one_line(message))}", highlight=False)
