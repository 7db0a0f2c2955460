"""A policy's roots reduced to the fewest that give the sandbox the same view."""

from __future__ import annotations


def is_within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


def normalized_roots(read_roots: tuple[str, ...], write_roots: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The fewest roots giving the same view (each list normalized and deduplicated).
    A path in both lists is a write root (a write root is readable too). A root whose
    nearest enclosing root is of its own kind adds nothing and is dropped; one inside a
    root of the other kind stays: a writable directory in a read-only view, or a
    read-only one in a writable view (what the caller asked for, never more). The order
    given is kept: binds follow it."""
    writes = set(write_roots)
    every = writes | set(read_roots)

    def enclosed_by_its_kind(path: str, writable: bool) -> bool:
        enclosing = [root for root in every if root != path and is_within(path, root)]
        if not enclosing:
            return False
        nearest = max(enclosing, key=len)  # normalized paths: the longest is the deepest
        return (nearest in writes) == writable

    kept_writes = tuple(p for p in write_roots if not enclosed_by_its_kind(p, True))
    kept_reads = tuple(p for p in read_roots if p not in writes and not enclosed_by_its_kind(p, False))
    return kept_reads, kept_writes
