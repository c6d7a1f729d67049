"""The demo models' corpus: the running interpreter's standard-library Python source.

Training reads every .py file below the standard library's folder except tests, vendored
packages, data tables and the HELD_OUT_MODULES, which are kept back to measure the models
on Python they never saw (benchmarks/eval_demo.py). Held-out modules are named rather than
pathed, so each Python version's own copy of them is the one left out and measured.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

# Left out of the corpus: tests (odd code, huge), vendored packages, and generated tables
# (codec maps, pydoc's topic text) that are data, not code.
EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__", "encodings", "pydoc_data"})

# Pure-Python modules of Python 3.11 and later, of several kinds (text, numbers, parsers,
# containers, files): ~290 KB, ~3% of the corpus. Never trained on.
HELD_OUT_MODULES = (
    "calendar", "colorsys", "csv", "filecmp", "fnmatch", "fractions", "glob", "graphlib", "heapq", "html.parser",
    "json.decoder", "json.encoder", "pprint", "queue", "reprlib", "sched", "shlex", "string", "textwrap",
    "tomllib._parser",
)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def module_file(name: str) -> Path | None:
    """The source file of a standard-library module (a plain module or a package), or None."""
    base = stdlib_root().joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def read_source(path: Path) -> str | None:
    """The file's text, or None for a file that is not UTF-8 (a few legacy test inputs)."""
    try:
        return path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None


def held_out_sources() -> dict[str, str]:
    """Module name -> source, for each held-out module this Python has, in HELD_OUT_MODULES' order."""
    sources = {}
    for name in HELD_OUT_MODULES:
        path = module_file(name)
        text = read_source(path) if path else None
        if text is not None:
            sources[name] = text
    return sources


def training_files() -> list[Path]:
    """The standard library's .py files that training may read, sorted: no excluded
    folders, no held-out modules."""
    root = stdlib_root()
    held_out = {module_file(name) for name in HELD_OUT_MODULES}
    return sorted(
        path for path in root.rglob("*.py")
        if not EXCLUDED_DIRS.intersection(path.relative_to(root).parts[:-1]) and path not in held_out
    )
