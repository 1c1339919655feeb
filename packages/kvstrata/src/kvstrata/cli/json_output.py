"""How a CLI command writes its `--json` document: indented JSON and a final newline, UTF-8.

A file that cannot be written is reported as one `error: cannot write PATH: ...` line on stderr
(`print_error`), and the command decides its exit status from the returned flag.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvstrata.cli.errors import print_error


def write_json(path: Path | None, document: object) -> bool:
    """Write `document` to `path` (nothing when `path` is None). False, after printing the
    error, when the file cannot be written (OSError); True otherwise."""
    if path is None:
        return True
    try:
        path.write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    except OSError as exc:
        print_error(f"cannot write {path}: {exc}")
        return False
    return True
