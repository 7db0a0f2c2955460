"""The daemon's configuration, loaded exactly as the daemon's start loads it
(core.settings.load_settings), with every error told as a field path and a reason:
an unknown key (and the setting it may have meant), a wrong type (and what was given),
a mode written in decimal, a malformed sha256, a YAML syntax error (its line), a file
that cannot be read. Then what the settings' models cannot see but would stop the
daemon's start halfway: a default backend that does not exist or is disabled, an
unknown log level, socket owner or group, a malformed metrics address. Used by the
daemon's start (before it makes anything) and by `sandboxd check`."""

from __future__ import annotations

import difflib
import grp
import logging
import os
import pwd
import re
import typing
from collections.abc import Sequence
from typing import Any, NamedTuple

import yaml
from pydantic import BaseModel, ValidationError

from sandboxd.check.report import BACKENDS
from sandboxd.core.artifact_settings import mask_userinfo
from sandboxd.core.safe_open import UnsafeFile, open_setting_file
from sandboxd.core.errors import InvalidArgument
from sandboxd.core.settings import DaemonSettings, load_settings
from sandboxd.policy.always_blocked import always_blocked

# A reason that starts with a setting's own path ("nsjail.nsjail_binary_sha256: ...",
# as the settings' validators write them): the path is taken from it.
_PATH_PREFIX = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*): (.+)", re.DOTALL)
_SHOWN_INPUT_CHARS = 60


class ConfigError(NamedTuple):
    field: str  # the setting's path ("limits.max_pids", "workspace_roots[1]"); "" for the file itself
    reason: str

    def __str__(self) -> str:
        return f"{self.field}: {self.reason}" if self.field else self.reason


def load_config(path: str | os.PathLike[str] | None,
                **overrides: Any) -> tuple[DaemonSettings | None, list[ConfigError]]:
    """The settings (None when they do not load) and every error found; `overrides`
    are the start's command-line settings, as load_settings takes them. A file that
    loads is then checked for what would stop the start (start_problems)."""
    held = -1
    if path:
        # Opened once, never blocking (a FIFO named as the config would hang the start),
        # a regular file checked on the descriptor; the settings read that same file
        # (its descriptor's /proc name, which no rename or swap of `path` changes).
        try:
            held, _st = open_setting_file(path, setting="", follow=True)
        except UnsafeFile as exc:
            return None, [ConfigError("", f"{path}: cannot be read: {exc.problem}")]
    try:
        settings = load_settings(f"/proc/self/fd/{held}" if path else None, **overrides)
    except OSError as exc:
        return None, [ConfigError("", f"{path}: cannot be read: {exc.strerror or exc}")]
    except yaml.YAMLError as exc:
        return None, [ConfigError("", f"{path}: not valid YAML: {_yaml_reason(exc)}")]
    except ValidationError as exc:
        return None, [validation_error(e) for e in exc.errors()]
    except UnicodeDecodeError as exc:  # told without the bytes around it
        return None, [ConfigError("", f"{path}: not UTF-8 text (byte {exc.start})")]
    except ValueError as exc:  # the file is no mapping (named by its descriptor: told by its path)
        return None, [ConfigError("", mask_userinfo(str(exc).replace(f"/proc/self/fd/{held}", os.fspath(path or ""))))]
    finally:
        if held >= 0:
            os.close(held)
    problems = start_problems(settings)
    return (None if problems else settings), problems


def render_errors(path: str | os.PathLike[str] | None, errors: Sequence[ConfigError]) -> str:
    """The daemon's message for a configuration it refuses: one line per error."""
    source = os.fspath(path) if path else "the embedded defaults and the command line"
    count = f"{len(errors)} error{'s' if len(errors) != 1 else ''}"
    return "\n".join([f"sandboxd: bad configuration ({source}): {count}"] + [f"  {e}" for e in errors])


def _yaml_reason(exc: yaml.YAMLError) -> str:
    """Where and what, never the line itself (PyYAML's own text quotes it, and the file
    may hold a secret: an endpoint's password)."""
    if isinstance(exc, yaml.MarkedYAMLError):
        mark = exc.problem_mark or exc.context_mark
        what = exc.problem or exc.context or "malformed"
        if mark is not None:
            return f"line {mark.line + 1}, column {mark.column + 1}: {what}"
        return what
    if isinstance(exc, yaml.reader.ReaderError):  # a byte that is no text: its code, and where
        return f"position {exc.position}: {exc.reason}"
    return type(exc).__name__


def validation_error(error: Any) -> ConfigError:
    """One of pydantic's errors (ValidationError.errors()) as a path and a reason; never a
    secret: no credential binding's value is echoed, and a URL's userinfo is masked."""
    found = _validation_error(error)
    return found._replace(reason=mask_userinfo(found.reason))


def _validation_error(error: Any) -> ConfigError:
    loc = tuple(error.get("loc", ()))
    kind, message = error.get("type", ""), str(error.get("msg", ""))
    key_error = bool(loc) and loc[-1] == "[key]"
    if key_error:
        loc = loc[:-1]
    path = field_path(loc)
    if kind == "extra_forbidden":
        return ConfigError(path, _unknown_key(loc))
    if kind == "missing":
        return ConfigError(path, "required, but missing")
    for prefix in ("Value error, ", "Assertion failed, "):
        if message.startswith(prefix):
            message = message[len(prefix):]
            match = _PATH_PREFIX.fullmatch(message)
            if match and _names_a_setting(match.group(1), path):
                return ConfigError(match.group(1), match.group(2))
            return ConfigError(path, message)
    shown = "a value not shown: a credential's" if _holds_secrets(loc) else _shown(error.get("input"))
    reason = f"{message} (got {shown})"
    return ConfigError(path, f"the key: {reason}" if key_error else reason)


def _holds_secrets(loc: Sequence[Any]) -> bool:
    """Whether a setting's value may be a secret, never to be echoed: a credential
    binding's (a command's argv may carry a token). A URL's userinfo is masked anywhere."""
    return bool(loc) and loc[0] == "credentials"


def field_path(loc: Sequence[Any]) -> str:
    """("limits", "max_pids") -> "limits.max_pids"; ("workspace_roots", 1) -> "workspace_roots[1]"."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _shown(value: Any) -> str:
    text = repr(int(value)) if isinstance(value, int) and not isinstance(value, bool) else repr(value)
    return text if len(text) <= _SHOWN_INPUT_CHARS else text[:_SHOWN_INPUT_CHARS] + "..."


def _unknown_key(loc: Sequence[Any]) -> str:
    model = _model_at(loc[:-1])
    if model is None or not isinstance(loc[-1], str):
        return "unknown key: no such setting"
    known = sorted(model.model_fields)
    close = difflib.get_close_matches(loc[-1], known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    where = f" of {field_path(loc[:-1])}" if loc[:-1] else ""
    return f"unknown key: no such setting{where}{hint}"


def _model_at(loc: Sequence[Any]) -> type[BaseModel] | None:
    """The settings model a path leads to (through nested models and the values of a
    mapping such as credentials.<id>), or None."""
    model: type[BaseModel] = DaemonSettings
    parts = list(loc)
    while parts:
        part = parts.pop(0)
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None:
            return None
        annotation = field.annotation
        if typing.get_origin(annotation) is dict and parts:
            parts.pop(0)  # the mapping's key
        found = _submodel(annotation)
        if found is None:
            return None
        model = found
    return model


def _submodel(annotation: Any) -> type[BaseModel] | None:
    """The settings model an annotation is or holds (TcpSettings | None, dict[str, CredentialBinding])."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _submodel(arg)
        if found is not None:
            return found
    return None


def _names_a_setting(prefix: str, path: str) -> bool:
    """Whether a reason's "<prefix>: " is a setting's path at or below the error's own."""
    if path and not (prefix == path or prefix.startswith(path + ".")):
        return False
    *parents, last = prefix.split(".")
    model = _model_at(parents)
    return model is not None and last in model.model_fields


def start_problems(settings: DaemonSettings) -> list[ConfigError]:
    """What the settings' models accept but the daemon's start would fail on, late:
    after it has made its directories (or with a traceback)."""
    problems = []
    if settings.default_backend not in BACKENDS:
        problems.append(ConfigError("default_backend", f"{settings.default_backend!r} is no backend "
                                                       f"(one of {', '.join(BACKENDS)})"))
    elif settings.default_backend == "nsjail" and not settings.nsjail.enabled:
        problems.append(ConfigError("default_backend", "nsjail is disabled (nsjail.enabled: false)"))
    if settings.log_level.upper() not in logging.getLevelNamesMapping():
        problems.append(ConfigError("log_level", f"{settings.log_level!r} is no log level "
                                                 "(DEBUG, INFO, WARNING, ERROR or CRITICAL)"))
    for name, value, lookup in (("socket_owner", settings.socket_owner, pwd.getpwnam),
                                ("socket_group", settings.socket_group, grp.getgrnam)):
        if value is not None and not value.isdigit():
            try:
                lookup(value)
            except KeyError:
                problems.append(ConfigError(name, f"no {'user' if name == 'socket_owner' else 'group'} "
                                                  f"named {value!r} on this host"))
    if settings.metrics_address is not None:
        host, sep, port = settings.metrics_address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
            problems.append(ConfigError("metrics_address", f"{settings.metrics_address!r} is not host:port"))
    try:
        always_blocked(settings.always_blocked)  # the start parses it too, and refuses a malformed one
    except InvalidArgument as exc:
        problems.append(ConfigError(exc.field or "always_blocked", exc.reason))
    return problems
