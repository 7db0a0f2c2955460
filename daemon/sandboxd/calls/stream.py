"""What a caller of Execute sees of a call, in order: accepted, started, output, finished."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class StreamItem:
    kind: str  # "accepted" | "started" | "output" | "finished"
    event_id: str = ""
    data: Any = None
