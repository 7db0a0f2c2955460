"""A finished sandboxd call made into the model's answer: a short text and the same facts
as structured content. Output is capped (capping.py) with the head and the tail kept;
the whole of it stays an artifact, named by its MCP resource URI. A timeout, a memory
kill, a refusal (of the daemon, or of a file tool's script) is an error result with its
reason; a command that ran and exited non-zero is not an error of the tool: its exit code
is the answer."""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any

from ..client import CallOutcome
from .capping import cap_output
from .tools import EXIT_TOO_LARGE, REFUSAL_EXITS, CommandPlan

ARTIFACT_URI = "sandboxd://artifacts/{artifact_id}"


@dataclass
class Reply:
    text: str
    structured: dict[str, Any] = field(default_factory=dict)
    is_error: bool = False


def artifact_uri(artifact_id: str) -> str:
    return ARTIFACT_URI.format(artifact_id=artifact_id)


def _artifacts(outcome: CallOutcome) -> list[dict[str, Any]]:
    return [{"artifact_id": a.artifact_id, "kind": a.kind, "uri": artifact_uri(a.artifact_id),
             "size_bytes": a.size_bytes, "content_hash": a.content_hash} for a in outcome.result.artifacts]


def _whole_at(outcome: CallOutcome, kind: str) -> str:
    for a in outcome.result.artifacts:
        if a.kind == kind:
            return f"the whole {kind} is artifact {a.artifact_id} ({artifact_uri(a.artifact_id)})"
    return f"the whole {kind} was not stored"


def _failure(outcome: CallOutcome) -> str | None:
    """Why the call failed as a call (not as a command that exited non-zero), or None."""
    r = outcome.result
    if r.timed_out:
        return f"timed out: {r.error.message or 'killed at its timeout'}"
    if r.oom_killed:
        return f"killed for memory: {r.error.message or 'at the memory limit'}"
    if r.status == "cancelled":
        return f"cancelled: {r.error.message}"
    if r.exit_code < 0:
        return f"{r.error.code or 'ERROR'}: {r.error.message or 'the sandbox failed before or around the command'}"
    return None


def _call_facts(outcome: CallOutcome) -> dict[str, Any]:
    r = outcome.result
    facts: dict[str, Any] = {"tool_call_id": outcome.tool_call_id, "status": r.status, "exit_code": r.exit_code,
                             "timed_out": r.timed_out, "oom_killed": r.oom_killed, "artifacts": _artifacts(outcome)}
    if r.signal:
        facts["signal"] = r.signal
    if r.error.code:
        facts["error"] = {"code": r.error.code, "message": r.error.message}
    effects = r.effects_observed
    changed = {k: list(getattr(effects, k)) for k in ("writes", "deletes") if getattr(effects, k)}
    if changed:
        facts["effects"] = changed
    return facts


def command_reply(outcome: CallOutcome, budget_bytes: int) -> Reply:
    """run_command's answer: exit code, the output capped per stream, the artifacts."""
    r = outcome.result
    facts = _call_facts(outcome)
    sections = []
    for kind, data, truncated in (("stdout", outcome.stdout, r.stdout_truncated),
                                  ("stderr", outcome.stderr, r.stderr_truncated)):
        capped = cap_output(data, budget_bytes, stream=kind, whole_at=_whole_at(outcome, kind))
        facts[kind] = capped.text
        facts[f"{kind}_bytes"] = capped.total_bytes
        if capped.cut:
            facts[f"{kind}_cut_bytes"] = capped.cut_bytes
        if truncated:  # the daemon's own cap (the policy's maxStdoutBytes / maxStderrBytes)
            facts[f"{kind}_truncated_by_policy"] = True
        if data:
            note = " (the policy's output cap ended it: the rest was never kept)" if truncated else ""
            sections.append(f"--- {kind}{note} ---\n{capped.text}")
    failure = _failure(outcome)
    killed = f" ({r.signal})" if r.signal else ""
    head = f"error: {failure}" if failure else f"exit code {r.exit_code}{killed}"
    return Reply("\n".join([f"{head} (call {outcome.tool_call_id})", *sections]), facts, is_error=failure is not None)


def _script_refusal(outcome: CallOutcome, plan: CommandPlan) -> Reply | None:
    """A file tool's script that refused (its exit code and its reason), or that failed."""
    failure = _failure(outcome)
    code = outcome.result.exit_code
    if failure is None and code == 0:
        return None
    reason = outcome.stderr.decode("utf-8", "replace").strip()
    facts = _call_facts(outcome)
    if failure is None and code in REFUSAL_EXITS:
        reason = reason.removeprefix("sandboxd-mcp: ")
        facts["refusal"] = {"code": REFUSAL_EXITS[code], "reason": reason}
        return Reply(f"refused: {reason} (call {outcome.tool_call_id})", facts, is_error=True)
    why = failure or f"exited with {code}: {cap_output(outcome.stderr, 4096, stream='stderr', whole_at='').text}"
    facts["failure"] = why
    return Reply(f"{plan.tool} failed: {why} (call {outcome.tool_call_id})", facts, is_error=True)


def read_reply(outcome: CallOutcome, plan: CommandPlan, cap_bytes: int) -> Reply:
    refused = _script_refusal(outcome, plan)
    if refused is not None:
        return refused
    data = outcome.stdout
    facts = _call_facts(outcome) | {"path": plan.detail["path"], "size_bytes": len(data)}
    if len(data) > cap_bytes:  # it grew between the script's check and its read
        facts["refusal"] = {"code": REFUSAL_EXITS[EXIT_TOO_LARGE], "reason": f"more than {cap_bytes} bytes"}
        return Reply(f"refused: {plan.detail['path']} is more than {cap_bytes} bytes", facts, is_error=True)
    try:
        text = data.decode("utf-8")
        facts |= {"encoding": "utf-8", "content": text}
    except UnicodeDecodeError:
        facts |= {"encoding": "base64", "content": base64.b64encode(data).decode()}
        text = f"[{len(data)} bytes of binary data; structured content has them as base64]"
    return Reply(text, facts)


def write_reply(outcome: CallOutcome, plan: CommandPlan) -> Reply:
    refused = _script_refusal(outcome, plan)
    if refused is not None:
        return refused
    facts = _call_facts(outcome) | {"path": plan.detail["path"], "bytes_written": plan.detail["bytes"]}
    return Reply(f"wrote {plan.detail['bytes']} bytes to {plan.detail['path']} (call {outcome.tool_call_id})", facts)


def _entries(data: bytes, limit: int) -> tuple[list[dict[str, Any]], int]:
    entries = []
    for raw in data.split(b"\0"):
        kind, _, rest = raw.decode("utf-8", "replace").partition(" ")
        size, _, path = rest.partition(" ")
        if not path:
            continue
        path = path.removeprefix("./")
        entries.append({"path": path, "type": {"d": "directory", "l": "symlink", "f": "file"}.get(kind, "other"),
                        "size_bytes": int(size) if size.isdigit() and kind == "f" else None})
    entries.sort(key=lambda e: str(e["path"]))
    return entries[:limit], max(0, len(entries) - limit)


def list_reply(outcome: CallOutcome, plan: CommandPlan, limit: int) -> Reply:
    refused = _script_refusal(outcome, plan) if outcome.result.exit_code != 1 or not outcome.stdout else None
    if refused is not None:
        return refused
    entries, more = _entries(outcome.stdout, limit)
    facts = _call_facts(outcome) | {"path": plan.detail["path"], "entries": entries}
    lines = [f"{plan.detail['path']} (to depth {plan.detail['max_depth']}):"]
    lines += [f"{e['path']}/" if e["type"] == "directory" else f"{e['path']} -> (symlink)" if e["type"] == "symlink"
              else f"{e['path']}  {e['size_bytes']} bytes" for e in entries]
    if more:
        facts["entries_cut"] = more
        lines.append(f"[... {more} more entries not shown: list a subdirectory, or lower max_depth]")
    if outcome.result.exit_code == 1:  # find went on past what it could not read
        lines.append(outcome.stderr.decode("utf-8", "replace").strip())
    return Reply("\n".join(lines), facts)


def search_reply(outcome: CallOutcome, plan: CommandPlan, budget_bytes: int) -> Reply:
    if outcome.result.exit_code == 1 and _failure(outcome) is None:  # grep and rg: no match
        return Reply(f"no matches under {plan.detail['path']}", _call_facts(outcome) | {"matches": ""})
    refused = _script_refusal(outcome, plan)
    if refused is not None:
        return refused
    capped = cap_output(outcome.stdout, budget_bytes, stream="the matches", whole_at=_whole_at(outcome, "stdout"))
    facts = _call_facts(outcome) | {"matches": capped.text, "match_lines": outcome.stdout.count(b"\n")}
    if capped.cut:
        facts["matches_cut_bytes"] = capped.cut_bytes
    return Reply(capped.text, facts)


def reply_for(plan: CommandPlan, outcome: CallOutcome, budget_bytes: int, read_cap: int, list_limit: int) -> Reply:
    if plan.tool == "run_command":
        return command_reply(outcome, budget_bytes)
    if plan.tool == "read_file":
        return read_reply(outcome, plan, read_cap)
    if plan.tool == "write_file":
        return write_reply(outcome, plan)
    if plan.tool == "list_files":
        return list_reply(outcome, plan, list_limit)
    return search_reply(outcome, plan, budget_bytes)


def refusal_reply(argument: str, reason: str) -> Reply:
    """A call refused here, before anything was sent: nothing ran, nothing was written."""
    return Reply(f"refused: {argument}: {reason} (nothing ran)",
                 {"refusal": {"argument": argument, "reason": reason}}, is_error=True)


def daemon_error_reply(code: str, message: str, tool_call_id: str, where: str) -> Reply:
    facts: dict[str, Any] = {"error": {"code": code, "message": message}}
    if tool_call_id:
        facts["tool_call_id"] = tool_call_id
    if code == "UNAVAILABLE":
        text = (f"sandboxd is not answering at {where} ({message}); nothing ran. This server keeps serving: "
                "retry once the daemon is back.")
    else:
        text = f"sandboxd refused the call: {code}: {message}"
    return Reply(text, facts, is_error=True)
