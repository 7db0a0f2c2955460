"""Where `sandboxctl` connects: flags, a named context of the client config file, or the
socket. The file (`~/.config/sandboxd/client.yaml`; `$SANDBOXD_CLIENT_CONFIG` or
`--config` name another) holds named contexts, so that mutual-TLS flags are not
repeated on every command:

    current_context: prod
    contexts:
      prod:  {address: "sandboxd.example:7443", ca: ca.pem, cert: me.pem, key: me.key}
      local: {socket: /run/sandboxd/sandboxd.sock}

Relative paths are taken from the file's directory. The order, first match wins (as
docker's): --socket or --tcp, --context, $SANDBOXD_CONTEXT, $SANDBOXD_SOCKET, the file's
current context, the default socket."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .client import TlsFiles, default_socket
from .local_files import write_whole

CONFIG_ENV = "SANDBOXD_CLIENT_CONFIG"
CONTEXT_ENV = "SANDBOXD_CONTEXT"
# The socket of $SANDBOXD_SOCKET or the default: what `context use default` goes back to.
DEFAULT_CONTEXT = "default"
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
_CONTEXT_KEYS = ("socket", "address", "ca", "cert", "key")
_TLS_KEYS = ("ca", "cert", "key")


class ConfigError(ValueError):
    """A client config file, a context or the connection flags that cannot be used."""


@dataclass(frozen=True)
class Context:
    name: str
    socket: str = ""
    address: str = ""
    ca: str = ""
    cert: str = ""
    key: str = ""

    def describe(self) -> str:
        return f"{self.address} (mutual TLS)" if self.address else f"unix:{self.socket}"

    def to_yaml(self) -> dict[str, str]:
        return {k: getattr(self, k) for k in _CONTEXT_KEYS if getattr(self, k)}


@dataclass
class ClientConfig:
    path: Path
    current: str = ""
    contexts: dict[str, Context] = field(default_factory=dict)
    exists: bool = False


@dataclass(frozen=True)
class Target:
    """A Unix socket, or a TCP address with the client's TLS files."""
    socket: str = ""
    address: str = ""
    tls: TlsFiles | None = None


def config_path(explicit: str | None = None, environ: Mapping[str, str] = os.environ) -> Path:
    if explicit:
        return Path(explicit)
    if environ.get(CONFIG_ENV):
        return Path(environ[CONFIG_ENV])
    base = environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "sandboxd" / "client.yaml"


def check_name(name: str, where: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise ConfigError(f"{where}: {name!r} is not a context name (letters, digits, '.', '_', '-'; "
                          "at most 63 characters)")
    if name == DEFAULT_CONTEXT:
        raise ConfigError(f"{where}: {DEFAULT_CONTEXT!r} is the built-in context (the socket); "
                          "choose another name")


def _context(path: Path, name: str, raw: Any) -> Context:
    where = f"{path}: contexts.{name}"
    check_name(name, f"{path}: contexts")
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must be a mapping of {', '.join(_CONTEXT_KEYS)}")
    for key, value in raw.items():
        if key not in _CONTEXT_KEYS:
            raise ConfigError(f"{where}.{key}: unknown (expected {', '.join(_CONTEXT_KEYS)})")
        if not isinstance(value, str) or not value:
            raise ConfigError(f"{where}.{key}: must be a non-empty string")
    if bool(raw.get("socket")) == bool(raw.get("address")):
        raise ConfigError(f"{where}: give exactly one of socket (a Unix socket) and address (HOST:PORT)")
    if raw.get("socket") and any(k in raw for k in _TLS_KEYS):
        raise ConfigError(f"{where}: ca, cert and key go with address (the socket needs none)")
    missing = [k for k in _TLS_KEYS if raw.get("address") and not raw.get(k)]
    if missing:
        raise ConfigError(f"{where}.{missing[0]}: required with address (the daemon speaks mutual TLS only)")

    def file(key: str) -> str:
        value = raw.get(key, "")
        return str(path.parent / os.path.expanduser(value)) if value and key != "address" else value

    return Context(name, **{k: file(k) for k in _CONTEXT_KEYS})


def load_config(path: Path) -> ClientConfig:
    """The file's contexts; a missing file is an empty config."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return ClientConfig(path)
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not YAML: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must be a mapping (current_context, contexts)")
    for key in data:
        if key not in ("current_context", "contexts"):
            raise ConfigError(f"{path}: {key}: unknown (expected current_context, contexts)")
    contexts = data.get("contexts") or {}
    if not isinstance(contexts, dict):
        raise ConfigError(f"{path}: contexts: must be a mapping of names to contexts")
    config = ClientConfig(path, exists=True,
                          contexts={str(n): _context(path, str(n), raw) for n, raw in contexts.items()})
    current = data.get("current_context") or ""
    if current and current != DEFAULT_CONTEXT and current not in config.contexts:
        raise ConfigError(f"{path}: current_context: no context {current!r} in the file")
    config.current = "" if current == DEFAULT_CONTEXT else current
    return config


def save_config(config: ClientConfig) -> None:
    """Written whole, atomically, readable by its owner only (it names key files); its
    directory made 0700 where missing, and nothing on the way a link another user planted."""
    data: dict[str, Any] = {}
    if config.current:
        data["current_context"] = config.current
    data["contexts"] = {name: c.to_yaml() for name, c in sorted(config.contexts.items())}
    text = yaml.safe_dump(data, default_flow_style=False, sort_keys=False)
    write_whole(config.path, lambda f: f.write(text.encode("utf-8")), mode=0o600, make_dirs=0o700)


def _flag(args: Any, name: str) -> Any:
    return getattr(args, name, None)


def _from_flags(args: Any) -> Target | None:
    """--socket or --tcp with the TLS flags; None when neither is given."""
    tls = {f"--tls-{k}": _flag(args, f"tls_{k}") for k in _TLS_KEYS}
    if _flag(args, "socket") and _flag(args, "tcp"):
        raise ConfigError("--socket and --tcp name two daemons: give one")
    given = [f for f, v in tls.items() if v]
    if given and not _flag(args, "tcp"):
        raise ConfigError(f"{given[0]} goes with --tcp (a context holds its TLS files: --context NAME)")
    if _flag(args, "tcp"):
        missing = [f for f, v in tls.items() if not v]
        if missing:
            raise ConfigError(f"--tcp needs {', '.join(missing)} (the daemon only speaks mutual TLS), "
                              "or a context that holds them (--context NAME)")
        return Target(address=args.tcp, tls=TlsFiles(args.tls_ca, args.tls_cert, args.tls_key))
    if _flag(args, "socket"):
        return Target(socket=args.socket)
    return None


def context_target(context: Context) -> Target:
    if context.address:
        return Target(address=context.address, tls=TlsFiles(context.ca, context.cert, context.key))
    return Target(socket=context.socket)


def resolve_target(args: Any, environ: Mapping[str, str] = os.environ) -> Target:
    """Where to connect (the order is the module's docstring's)."""
    flagged = _from_flags(args)
    named = _flag(args, "context")
    if flagged is not None and named:
        raise ConfigError("--context and --socket/--tcp both say where to connect: give one")
    if flagged is not None:
        return flagged
    name, where = (named, "--context") if named else (environ.get(CONTEXT_ENV, ""), f"${CONTEXT_ENV}")
    if not name and environ.get("SANDBOXD_SOCKET"):
        return Target(socket=environ["SANDBOXD_SOCKET"])
    config = load_config(config_path(_flag(args, "config"), environ))
    if not name:
        name, where = config.current, f"{config.path}: current_context"
    if not name or name == DEFAULT_CONTEXT:
        return Target(socket=default_socket())
    context = config.contexts.get(name)
    if context is None:
        known = ", ".join(sorted(config.contexts)) or "none"
        raise ConfigError(f"{where}: no context {name!r} in {config.path} (contexts: {known})")
    return context_target(context)
