"""The daemon's shape (issue 21): no module over 500 lines, no function over 80, and no
work at import time (no thread started by an import). The import layers themselves are
the contract in pyproject.toml, checked by `make lint`."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import sandboxd

DAEMON = Path(sandboxd.__file__).parent
MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80


def daemon_sources() -> list[Path]:
    return sorted(p for p in DAEMON.rglob("*.py") if "pb" not in p.relative_to(DAEMON).parts)


def long_functions(path: Path) -> list[str]:
    """`name (lines)` of each function over the limit, counted from its `def` to its end."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                found.append(f"{node.name}:{node.lineno} ({lines})")
    return found


def test_the_daemon_has_sources_to_check():
    sources = {p.relative_to(DAEMON).as_posix() for p in daemon_sources()}
    assert {"main.py", "api/server.py", "core/errors.py"} <= sources


def test_no_module_is_over_500_lines():
    over = {p.relative_to(DAEMON).as_posix(): n for p in daemon_sources()
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES}
    assert not over, f"modules over {MAX_MODULE_LINES} lines: {over}"


def test_no_function_is_over_80_lines():
    over = {p.relative_to(DAEMON).as_posix(): f for p in daemon_sources() if (f := long_functions(p))}
    assert not over, f"functions over {MAX_FUNCTION_LINES} lines: {over}"


def test_the_function_measure_counts_from_def_to_end(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES - 1))
    fits, over = tmp_path / "fits.py", tmp_path / "over.py"
    fits.write_text(f"def f():\n{body}\n")
    over.write_text(f"def f():\n{body}\n    return 0\n")
    assert long_functions(fits) == [] and long_functions(over) == [f"f:1 ({MAX_FUNCTION_LINES + 1})"]


IMPORT_EVERY_MODULE = r"""
import importlib, json, pkgutil, sys, threading
import sandboxd

started = {}
before = threading.active_count()
for info in pkgutil.walk_packages(sandboxd.__path__, "sandboxd."):
    if ".pb" in info.name:
        continue
    importlib.import_module(info.name)
    now = threading.active_count()
    if now != before:
        started[info.name] = sorted(t.name for t in threading.enumerate())
        before = now
print(json.dumps(started))
"""


def test_importing_every_daemon_module_starts_no_thread():
    """In a fresh interpreter: each module whose import (with what it imports) changed
    the number of threads, and the threads there were then."""
    out = subprocess.run([sys.executable, "-c", IMPORT_EVERY_MODULE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]
    started = json.loads(out.stdout.strip().splitlines()[-1])
    assert not started, f"imports that started threads: {started}"
