"""`sandboxctl context` (named daemons in the client config file) and `sandboxctl
completion` (shell completion scripts): nothing here talks to a daemon."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

from .cli_common import dump_json, fail, print_table
from .contexts import (CONTEXT_ENV, DEFAULT_CONTEXT, ClientConfig, ConfigError, Context, check_name, config_path,
                       load_config, save_config)
from .client import default_socket


def _config(args: argparse.Namespace) -> ClientConfig:
    return load_config(config_path(getattr(args, "config", None)))


def _in_use(config: ClientConfig) -> str:
    return os.environ.get(CONTEXT_ENV) or config.current or DEFAULT_CONTEXT


def context_ls(args: argparse.Namespace) -> int:
    config = _config(args)
    current = _in_use(config)
    contexts = [Context(DEFAULT_CONTEXT, socket=default_socket())] + [config.contexts[n] for n in sorted(config.contexts)]
    if args.json:
        print(dump_json([{"name": c.name, "current": c.name == current, **c.to_yaml()} for c in contexts]))
        return 0
    rows = [("", "NAME", "TARGET")]
    rows += [("*" if c.name == current else "", c.name, c.describe()) for c in contexts]
    print_table(rows)
    return 0


def context_use(args: argparse.Namespace) -> int:
    config = _config(args)
    if args.name != DEFAULT_CONTEXT and args.name not in config.contexts:
        known = ", ".join(sorted(config.contexts)) or "none"
        return fail(f"no context {args.name!r} in {config.path} (contexts: {known})", 1)
    config.current = "" if args.name == DEFAULT_CONTEXT else args.name
    save_config(config)
    print(f"current context: {args.name} ({config.path})", file=sys.stderr)
    if os.environ.get(CONTEXT_ENV):
        print(f"note: ${CONTEXT_ENV} ({os.environ[CONTEXT_ENV]}) still overrides it in this shell", file=sys.stderr)
    return 0


def context_set(args: argparse.Namespace) -> int:
    """A context made (or replaced) from the connection flags given with it."""
    check_name(args.name, "context set")
    socket, tcp = getattr(args, "socket", None), getattr(args, "tcp", None)
    tls = [getattr(args, f"tls_{k}", None) for k in ("ca", "cert", "key")]
    if bool(socket) == bool(tcp):
        return fail("context set needs --socket PATH, or --tcp HOST:PORT with --tls-ca, --tls-cert and --tls-key", 2)
    if socket and any(tls):
        return fail("--tls-* go with --tcp (the socket needs none)", 2)
    if tcp and not all(tls):
        return fail("--tcp needs --tls-ca, --tls-cert and --tls-key (the daemon only speaks mutual TLS)", 2)
    config = _config(args)
    ca, cert, key = (os.path.abspath(f) if f else "" for f in tls)
    context = Context(args.name, socket=os.path.abspath(socket) if socket else "", address=tcp or "", ca=ca,
                      cert=cert, key=key)
    config.contexts[args.name] = context
    save_config(config)
    print(f"context {args.name}: {context.describe()} ({config.path})", file=sys.stderr)
    return 0


def context_rm(args: argparse.Namespace) -> int:
    config = _config(args)
    if config.contexts.pop(args.name, None) is None:
        return fail(f"no context {args.name!r} in {config.path}", 1)
    if config.current == args.name:
        config.current = ""
    save_config(config)
    return 0


CONTEXT_COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {
    "ls": context_ls, "use": context_use, "set": context_set, "rm": context_rm}


def cmd_context(args: argparse.Namespace) -> int:
    try:
        return CONTEXT_COMMANDS[args.context_command](args)
    except ConfigError as exc:
        return fail(str(exc), 1)
