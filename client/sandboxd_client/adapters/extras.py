"""The ImportError an adapter raises when its framework is not installed: it names the
client package's extra that installs it."""

from __future__ import annotations


def require_extra(exc: ImportError, module: str, framework: str, extra: str) -> None:
    """Raises an ImportError naming `extra` when `exc` says `module` (the framework's
    top-level package) is missing; returns otherwise, for the caller to re-raise `exc`
    (the framework is there but failed to import: its own error says why)."""
    missing = (exc.name or "").partition(".")[0]
    if missing != module:
        return
    raise ImportError(f"this adapter needs {framework}, which is not installed: "
                      f"pip install 'sandboxd-client[{extra}]'", name=module) from exc
