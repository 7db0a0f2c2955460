"""Who a call is for: the principal a connection's uid (or certificate) maps to."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Principal:
    name: str
    uid: int
    admin: bool
