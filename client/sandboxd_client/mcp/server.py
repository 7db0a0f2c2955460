"""The MCP server: the official SDK's low-level Server with the tools of tools.py, each a
sandboxd call made by runner.py, and the artifacts those calls produced as resources
(`sandboxd://artifacts/{artifact_id}`).

Errors, by kind: malformed arguments are a JSON-RPC error (INVALID_PARAMS) naming the
argument; whatever the policy refuses (here or in the daemon), a timeout, a memory kill
and a daemon that does not answer are tool results with isError and the reason, so that
the model reads them. Who asked goes into every call: `proposedBy` is the MCP client's
name and version (its initialize clientInfo), `sessionId` the MCP session's id (on
stdio, where a process is one session, an id this server made at its start)."""

from __future__ import annotations

import base64
import logging
import re
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import mcp_types as types
from mcp.server import Server, ServerRequestContext
from mcp.shared.exceptions import MCPError
from mcp_types import INVALID_PARAMS

from .. import __version__
from ..errors import SandboxdClientError
from .arguments import ArgumentError, check_arguments, input_schema
from .config import ServerConfig
from .narrowing import Refusal, command_policy
from .results import ARTIFACT_URI, Reply, artifact_uri, daemon_error_reply, refusal_reply, reply_for
from .runner import ArtifactUnavailable, DaemonRunner
from .tools import CommandPlan, TooLarge, ToolSpec, plan, tool_specs

log = logging.getLogger("sandboxd_client.mcp.server")

SERVER_NAME = "sandboxd"
TOOL_ID_PREFIX = "mcp."
# Client-chosen strings that go into the call (the daemon takes 256 characters).
_MAX_CLIENT_TEXT = 120
_UNSAFE = re.compile(r"[^\x21-\x7e]+")
_ARTIFACT_RE = re.compile(r"sandboxd://artifacts/([A-Za-z0-9._:-]{1,128})")
MAX_LISTED_ARTIFACTS = 100


def client_text(value: str) -> str:
    """A client's self-description as the trace keeps it: printable ASCII, no spaces."""
    return _UNSAFE.sub("_", value)[:_MAX_CLIENT_TEXT]


def proposed_by(ctx: ServerRequestContext[Any, Any]) -> str:
    params = ctx.session.client_params
    if params is None or params.client_info is None:
        return "mcp:unknown-client"
    info = params.client_info
    name = client_text(info.name or "unnamed")
    return f"mcp:{name}/{client_text(info.version)}" if info.version else f"mcp:{name}"


def session_id(ctx: ServerRequestContext[Any, Any], fallback: str) -> str:
    """The streamable HTTP session's id (its transport checked the header against the
    session it routed to), else this server's own."""
    headers = getattr(ctx.request, "headers", None)
    value = headers.get("mcp-session-id") if headers is not None else None
    return f"mcp-session:{client_text(value)}" if value else fallback


class SandboxdMcp:
    """The server's state for its life: the config, the runner, the tools."""

    def __init__(self, config: ServerConfig, runner: DaemonRunner | None = None):
        self.config = config
        self.runner = runner or DaemonRunner(config.connect, workspace=config.workspace,
                                             policy=config.operator.policy, image=config.image,
                                             adapter=config.adapter, lease=config.lease)
        self.specs: dict[str, ToolSpec] = {s.name: s for s in tool_specs(config.operator, config.limits)}
        # stdio: one process is one session; calls without an MCP session share this id.
        self.own_session = f"mcp-server:{uuid.uuid4().hex[:16]}"

    def call_json(self, spec: ToolSpec, p: CommandPlan, ctx: ServerRequestContext[Any, Any]) -> dict[str, Any]:
        op = self.config.operator
        call: dict[str, Any] = {
            "toolId": TOOL_ID_PREFIX + spec.name, "toolVersion": __version__,
            "proposedBy": proposed_by(ctx), "sessionId": session_id(ctx, self.own_session),
            "argv": p.argv, "workspace": self.config.workspace,
            "policy": command_policy(op, p.timeout_ms, p.max_stdout_bytes),
            "authorization": {"status": "not_required"},
            "runtime": {"image": self.config.image, "adapter": self.config.adapter},
        }
        if p.cwd:
            call["cwd"] = p.cwd
        if p.stdin:
            call["stdin"] = p.stdin
        return call

    async def call_tool(self, ctx: ServerRequestContext[Any, Any], name: str, arguments: dict[str, Any] | None) -> Reply:
        spec = self.specs.get(name)
        if spec is None:
            raise MCPError(INVALID_PARAMS, f"unknown tool {name!r} (tools: {', '.join(self.specs)})")
        try:
            args = check_arguments(name, spec.fields, arguments)
        except ArgumentError as exc:
            raise MCPError(INVALID_PARAMS, str(exc), {"argument": exc.argument, "reason": exc.reason}) from None
        limits = self.config.limits
        try:
            p = plan(name, self.config.operator, limits, args)
        except Refusal as exc:
            return refusal_reply(exc.argument, exc.reason)
        except TooLarge as exc:
            return refusal_reply(exc.argument, f"{exc.size} bytes, more than the {exc.cap} bytes the operator allows")
        call = self.call_json(spec, p, ctx)
        try:
            outcome = await anyio.to_thread.run_sync(self.runner.run, call, p.timeout_ms)
        except SandboxdClientError as exc:
            return daemon_error_reply(exc.code.name, exc.message, exc.tool_call_id, self.config.daemon_address())
        return reply_for(p, outcome, limits.output_bytes, limits.read_bytes, limits.list_entries)

    def tools(self) -> list[types.Tool]:
        return [types.Tool(name=s.name, title=s.title, description=s.description, input_schema=input_schema(s.fields),
                           annotations=types.ToolAnnotations(title=s.title, read_only_hint=s.read_only,
                                                             destructive_hint=s.destructive,
                                                             idempotent_hint=s.idempotent,
                                                             open_world_hint=s.open_world))
                for s in self.specs.values()]

    async def read_artifact(self, uri: str) -> types.ReadResourceResult:
        match = _ARTIFACT_RE.fullmatch(uri)
        if match is None:
            raise MCPError(INVALID_PARAMS, f"no resource {uri!r}: this server offers {ARTIFACT_URI}")
        try:
            ref, data = await anyio.to_thread.run_sync(self.runner.download, match.group(1),
                                                       self.config.resource_bytes)
        except ArtifactUnavailable as exc:
            raise MCPError(INVALID_PARAMS, str(exc)) from None
        except SandboxdClientError as exc:
            raise MCPError(INVALID_PARAMS, f"artifact {match.group(1)}: {exc.code.name}: {exc.message}") from None
        try:
            contents: types.TextResourceContents | types.BlobResourceContents = types.TextResourceContents(
                uri=uri, mime_type="text/plain", text=data.decode("utf-8"))
        except UnicodeDecodeError:
            contents = types.BlobResourceContents(uri=uri, mime_type="application/octet-stream",
                                                  blob=base64.b64encode(data).decode())
        return types.ReadResourceResult(contents=[contents])

    def resources(self) -> list[types.Resource]:
        return [types.Resource(uri=artifact_uri(ref.artifact_id), name=ref.artifact_id,
                               description=f"{ref.kind} of call {ref.tool_call_id}", size=ref.size_bytes)
                for ref in self.runner.known_artifacts()[:MAX_LISTED_ARTIFACTS]]


def _result(reply: Reply) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=reply.text)], structured_content=reply.structured,
                                is_error=reply.is_error)


def build_server(app: SandboxdMcp) -> Server[SandboxdMcp]:
    """The SDK server; its lifespan gives the lease back when the server ends."""

    @asynccontextmanager
    async def lifespan(_: Server[SandboxdMcp]) -> AsyncIterator[SandboxdMcp]:
        try:
            yield app
        finally:
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(app.runner.close)

    async def list_tools(ctx: ServerRequestContext[SandboxdMcp, Any],
                         params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
        return types.ListToolsResult(tools=app.tools())

    async def call_tool(ctx: ServerRequestContext[SandboxdMcp, Any],
                        params: types.CallToolRequestParams) -> types.CallToolResult:
        return _result(await app.call_tool(ctx, params.name, params.arguments))

    async def list_resources(ctx: ServerRequestContext[SandboxdMcp, Any],
                             params: types.PaginatedRequestParams | None) -> types.ListResourcesResult:
        return types.ListResourcesResult(resources=app.resources())

    async def list_templates(ctx: ServerRequestContext[SandboxdMcp, Any],
                             params: types.PaginatedRequestParams | None) -> types.ListResourceTemplatesResult:
        template = types.ResourceTemplate(uri_template=ARTIFACT_URI, name="artifact",
                                          description="the whole stored output of a call (named in tool results)")
        return types.ListResourceTemplatesResult(resource_templates=[template])

    async def read_resource(ctx: ServerRequestContext[SandboxdMcp, Any],
                            params: types.ReadResourceRequestParams) -> types.ReadResourceResult:
        return await app.read_artifact(str(params.uri))

    return Server(SERVER_NAME, version=__version__, title="sandboxd",
                  instructions="Every tool runs in a sandboxd sandbox under a policy the operator fixed; the "
                               "workspace is /workspace. Long output is cut in the middle: the result names the "
                               "artifact resource that holds all of it.",
                  lifespan=lifespan, on_list_tools=list_tools, on_call_tool=call_tool, on_list_resources=list_resources,
                  on_list_resource_templates=list_templates, on_read_resource=read_resource)
