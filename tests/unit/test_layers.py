"""The daemon's shape (issue 21): no module over 500 lines, no function over 80, no work
at import time (no thread started by an import), and the log's rooms kept: SQL and event
drafts only in ledger/. The import layers themselves are
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


SQL_WORDS = ("SELECT ", "INSERT ", "UPDATE ", "DELETE FROM", "CREATE TABLE", "CREATE INDEX", "PRAGMA ")


def outside_the_ledger() -> list[Path]:
    return [p for p in daemon_sources() if p.relative_to(DAEMON).parts[0] != "ledger"]


def sql_strings(path: Path) -> list[str]:
    """String constants that read as SQL statements."""
    return [f"{path.name}:{node.lineno}" for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.Constant) and isinstance(node.value, str)
            and node.value.lstrip().upper().startswith(SQL_WORDS)]


def event_drafts(path: Path) -> list[str]:
    """Calls that build an EventDraft by hand (a type name and a payload dict)."""
    return [f"{path.name}:{node.lineno}" for node in ast.walk(ast.parse(path.read_text(), str(path)))
            if isinstance(node, ast.Call) and (getattr(node.func, "id", None) == "EventDraft"
                                               or getattr(node.func, "attr", None) == "EventDraft")]


def test_no_sql_outside_the_ledger():
    found = [hit for p in outside_the_ledger() for hit in sql_strings(p)]
    assert not found, f"SQL outside ledger/: {found}"
    assert sql_strings(DAEMON / "ledger" / "call_rows.py"), "the measure finds the ledger's own SQL"


def test_every_event_is_drafted_through_its_type():
    found = [hit for p in outside_the_ledger() for hit in event_drafts(p)]
    assert not found, f"events drafted as dicts outside ledger/ (use ledger.event_types.draft): {found}"
    assert event_drafts(DAEMON / "ledger" / "event_types.py"), "the measure finds the ledger's own drafts"


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


def import_cycles(imports: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for root in imports:
        if root in index:
            continue
        work = [(root, iter(sorted(imports.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(imports.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    cycles.append(sorted(group))
    return cycles


def test_the_cycle_finder_finds_a_cycle_and_only_cycles():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}}) == []


def test_no_module_of_the_daemon_imports_itself_back():
    """Between any two modules, also within a package and behind TYPE_CHECKING (grimp
    reads every import statement)."""
    import grimp

    graph = grimp.build_graph("sandboxd", "sandboxd_contract")
    imports = {m: {i for i in graph.find_modules_directly_imported_by(m) if i.split(".")[0] in
                   ("sandboxd", "sandboxd_contract")} for m in graph.modules}
    assert len(imports) > 100
    assert import_cycles(imports) == []
