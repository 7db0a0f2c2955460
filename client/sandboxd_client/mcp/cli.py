"""`sandboxd-mcp`: parse the operator's options, check the policy with the daemon when it
answers, and serve MCP on stdio (the default) or streamable HTTP (--http). Exit 2 when
the options cannot be served (the reason on stderr); stdout is the MCP stream on stdio,
so everything else goes to stderr."""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any

import yaml

from ..contexts import ConfigError
from ..errors import SandboxdClientError, Unavailable
from .config import ServerConfig, UsageError, server_config

EXIT_USAGE = 2


def _fail(message: str) -> int:
    print(f"sandboxd-mcp: {message}", file=sys.stderr, flush=True)
    return EXIT_USAGE


def check_with_daemon(config: ServerConfig) -> str | None:
    """The daemon's refusal of the operator's policy and workspace (ExplainPolicy: nothing
    runs), or None. A daemon that does not answer yet is no reason not to start: each
    tool call says so until it is back."""
    try:
        with config.connect() as client:
            client.explain(config.operator.policy, config.workspace, image=config.image)
    except Unavailable as exc:
        logging.getLogger("sandboxd_client.mcp").warning("sandboxd does not answer at %s yet (%s); serving anyway",
                                                         config.daemon_address(), exc.message)
    except SandboxdClientError as exc:
        return f"sandboxd refuses this policy or workspace: {exc.code.name}: {exc.message}"
    return None


async def _end_on_signal(app: Any) -> None:
    """SIGTERM or SIGINT on stdio: the lease given back, then the process ends (128 + the
    signal). Cancelling the server would not do: the SDK reads stdin in a worker thread
    that no cancellation reaches, so a client that signals without closing stdin first
    would wait for ever."""
    import anyio

    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for signum in signals:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(app.runner.release_now)
            os._exit(128 + signum)


async def _serve_stdio(server: Any, app: Any) -> None:
    import anyio
    from mcp.server.stdio import stdio_server

    async with anyio.create_task_group() as tg:
        tg.start_soon(_end_on_signal, app)
        async with stdio_server() as (read_stream, write_stream):
            await server.run(read_stream, write_stream, server.create_initialization_options())
        tg.cancel_scope.cancel()


def serve(config: ServerConfig) -> None:
    import anyio

    from .server import SandboxdMcp, build_server

    app = SandboxdMcp(config)
    server = build_server(app)
    if config.http is None:
        anyio.run(_serve_stdio, server, app)
        return
    from .http import serve_http

    anyio.run(serve_http, config.http, server)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING, format="sandboxd-mcp: %(message)s")
    try:
        import mcp.server  # noqa: F401  (the `mcp` extra)
    except ImportError:
        return _fail("the MCP SDK is not installed: pip install 'sandboxd-client[mcp]'")
    try:
        config = server_config(argv)
        refusal = check_with_daemon(config)
        if refusal is not None:
            return _fail(refusal)
        serve(config)
    except (UsageError, ConfigError, OSError, ValueError, yaml.YAMLError) as exc:
        return _fail(str(exc))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
