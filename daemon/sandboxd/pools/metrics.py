"""The pools' Prometheus families: by pool key and backend only (no workspace paths)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sandboxd.core.metrics import Histogram, render

# (metric name, field of a pool's listing, type, help)
POOL_FAMILIES = (
    ("sandboxd_pool_idle_sandboxes", "idle", "gauge", "Warm sandboxes waiting for a lease"),
    ("sandboxd_pool_leased_sandboxes", "leased", "gauge", "Warm sandboxes leased"),
    ("sandboxd_pool_created_total", "created", "counter", "Warm sandboxes created"),
    ("sandboxd_pool_destroyed_total", "destroyed", "counter", "Warm sandboxes destroyed"),
)


def render_pool_metrics(pools: Sequence[Mapping[str, Any]], acquire_latency: Histogram) -> str:
    """The exposition text of every pool (as PoolManager.list gives them) and of the
    AcquireSandbox latency."""
    families = []
    for name, field_, kind, help_text in POOL_FAMILIES:
        families.append((name, kind, help_text, [
            f'{name}{{pool="{p["poolKey"]}",backend="{p["backend"]}"}} {p[field_]}' for p in pools]))
    families.append(("sandboxd_pool_acquire_seconds", "histogram", "AcquireSandbox latency",
                     acquire_latency.render("sandboxd_pool_acquire_seconds")))
    return render(families)
