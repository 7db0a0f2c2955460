"""The config file as YAML, read once without blocking (a FIFO named as the config is
refused, never waited on): PyYAML's safe loader, except that an int spelled in plain
decimal is told apart from an octal one, so that FileMode refuses a mode written in
decimal (660 would be 0o1224) instead of misreading it."""

from __future__ import annotations

import os
import re
from typing import Annotated, Any

import yaml
from pydantic import BeforeValidator

from sandboxd.core.safe_open import open_setting_file


class _DecimalInt(int):
    """An int the config file spelled in decimal (`660`), told apart from an octal one
    (`0660`, `0o660`) so that a mode written in decimal is refused, never misread."""


class _SettingsLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that an int spelled in plain decimal is a _DecimalInt."""

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        value = super().construct_yaml_int(node)
        spelled = str(node.value).replace("_", "").lstrip("+-")
        return _DecimalInt(value) if spelled.isdigit() and not spelled.startswith("0") else value


_SettingsLoader.add_constructor("tag:yaml.org,2002:int", _SettingsLoader.construct_yaml_int)
_OCTAL = re.compile(r"0[oO]?([0-7]+)")


def _file_mode(value: Any) -> int:
    """A permission mode: an int as given (Python's 0o660, or YAML 1.1's 0660, which
    PyYAML reads as octal already), or an octal string ("0o660", "0660", YAML's 0o660).
    Refused: a mode the config file spelled in decimal (660 would be 0o1224; 432 is
    0o660 but reads as a typo), a string that is no octal number, anything outside
    0..0o777 (set-id and sticky bits mean nothing on a socket)."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a mode: write it in octal, e.g. 0o660")
    if isinstance(value, _DecimalInt) and value > 0:
        digits = str(int(value))
        meant = f"0o{digits}" if set(digits) <= set("01234567") else f"{int(value):#o}"
        raise ValueError(f"{digits} is written in decimal (= {int(value):#o}): write a mode in octal, e.g. {meant}")
    if isinstance(value, str):
        match = _OCTAL.fullmatch(value.strip())
        if not match:
            raise ValueError(f"{value!r} is not an octal mode: write it as 0o660 or 0660 (digits 0-7)")
        value = int(match.group(1), 8)
    if not isinstance(value, int):
        raise ValueError(f"{value!r} is not a mode: write it in octal, e.g. 0o660")
    if not 0 <= value <= 0o777:
        raise ValueError(f"{int(value):#o} is outside 0o0..0o777 (permission bits only)")
    return int(value)


# Every *_mode setting: see _file_mode for what is accepted.
FileMode = Annotated[int, BeforeValidator(_file_mode)]


def read_config_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The file's mapping ({} for an empty file); ValueError when it holds no mapping."""
    fd, _st = open_setting_file(path, setting="", follow=True)
    with os.fdopen(fd, encoding="utf-8") as f:
        data = yaml.load(f, Loader=_SettingsLoader) or {}  # noqa: S506 (a SafeLoader)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the config file must be a mapping")
    return data
