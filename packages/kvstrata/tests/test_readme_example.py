"""The README's "Use kvstrata in your engine" block runs as written (read out of the README)."""

from __future__ import annotations

import re
from pathlib import Path

from kvstrata.allocation import BatchAllocator
from kvstrata.build import MemorySystem

README = Path(__file__).resolve().parents[1] / "README.md"


def _example() -> str:
    text = README.read_text()
    section = text.split("## Use kvstrata in your engine", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None, "no python block under the heading"
    return match.group(1)


def test_readme_engine_example_runs() -> None:
    code = _example()
    assert 15 <= len(code.splitlines()) <= 40
    namespace: dict[str, object] = {}
    exec(compile(code, str(README), "exec"), namespace)
    alloc, system = namespace["alloc"], namespace["system"]
    assert isinstance(alloc, BatchAllocator) and isinstance(system, MemorySystem)
    assert not alloc.running
    system.check_integrity()
