"""The documentation's examples are real: every YAML block of README.md, SECURITY.md and
docs/*.md loads as what it claims to be, every Python block compiles against the client
it imports, and the README's table of defaults holds the code's numbers.

A YAML block says what it is in its fence's info string (```yaml sandboxd-config,
```yaml policy, ```yaml call, ```yaml sandboxctl-config) or, without one, by its keys. A
block that is none of these fails: an example nobody can load is a wrong example."""

from __future__ import annotations

import ast
import importlib
import re
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from sandboxd.core.settings import DaemonSettings, LimitSettings, load_settings
from sandboxd.policy.models import SandboxPolicy, parse_call, resolve_policy
from sandboxd_contract.calls import build_call

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
KINDS = ("sandboxd-config", "policy", "call", "sandboxctl-config")
POLICY_SECTIONS = {"filesystem", "network", "environment", "process", "audit"}
CLIENT_CONFIG_KEYS = {"current_context", "contexts"}
# Fixed so that no example depends on this machine's CPU count (the daemon's default
# maximum is 1000 per CPU).
LIMITS = LimitSettings(max_cpu_millicores=8000)
# A fenced block (indented too, inside a list): its info string and its body.
_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^\n`]*)\n"
                    r"(?P<body>.*?)^[ \t]*(?P=fence)[ \t]*$", re.M | re.S)


@dataclass(frozen=True)
class Block:
    doc: Path
    line: int
    language: str
    kind: str  # the info string's second word, or ""
    text: str

    def __str__(self) -> str:
        return f"{self.doc.relative_to(ROOT)}:{self.line}"


def doc_files() -> list[Path]:
    return sorted(ROOT.glob("*.md")) + sorted((ROOT / "docs").glob("*.md"))


def fenced_blocks(doc: Path) -> list[Block]:
    text = doc.read_text(encoding="utf-8")
    blocks = []
    for m in _FENCE.finditer(text):
        words = m["info"].split()
        body = textwrap.dedent(m["body"]) if m["indent"] else m["body"]
        blocks.append(Block(doc, text.count("\n", 0, m.start()) + 1, words[0].lower() if words else "",
                            words[1] if len(words) > 1 else "", body))
    return blocks


def yaml_blocks() -> list[Block]:
    return [b for doc in doc_files() for b in fenced_blocks(doc) if b.language in ("yaml", "yml")]


def python_blocks() -> list[Block]:
    return [b for doc in doc_files() for b in fenced_blocks(doc) if b.language in ("python", "py")]


def kind_of(block: Block, data: Any) -> str:
    """What a block is: its info string's word, else what its keys say; "" for neither."""
    if block.kind:
        return block.kind if block.kind in KINDS else ""
    if not isinstance(data, dict) or not data:
        return ""
    keys = set(data)
    if keys <= set(DaemonSettings.model_fields):
        return "sandboxd-config"
    if keys <= POLICY_SECTIONS:
        return "policy"
    if {"toolId", "argv"} <= keys:
        return "call"
    if keys <= CLIENT_CONFIG_KEYS:
        return "sandboxctl-config"
    return ""


# ------------------------------------------------------------------ the loaders

def load_daemon_config(text: str, tmp_path: Path) -> DaemonSettings:
    """As `sandboxd --config` loads it. Files the example names under /etc/sandboxd exist
    in a temporary directory (the TCP listener's certificates must be files)."""
    etc = tmp_path / "etc"
    text = text.replace("/etc/sandboxd/", f"{etc}/")
    for name in re.findall(rf"{re.escape(str(etc))}/[\w./-]+", text):
        Path(name).parent.mkdir(parents=True, exist_ok=True)
        Path(name).touch()
    path = tmp_path / "example.yaml"
    path.write_text(text)
    return load_settings(path)


def call_with(policy: Any) -> dict[str, Any]:
    return {"toolId": "docs.example", "argv": ["true"], "workspace": "/srv/sandboxd/workspaces/docs",
            "authorization": {"status": "not_required"}, "policy": policy}


def check_call(data: dict[str, Any]) -> None:
    """As the daemon admits it (the model, then every default and maximum applied), and
    as the client sends it (the proto's JSON form)."""
    inheritable = {name: "example" for name in DaemonSettings().inheritable_env}
    resolve_policy(parse_call(data), LIMITS, inheritable)
    build_call(data)


def load_client_config(text: str, tmp_path: Path) -> None:
    contexts = importlib.import_module("sandboxd_client.contexts")
    path = tmp_path / "client.yaml"
    path.write_text(text)
    contexts.load_config(path)


def check_block(block: Block, tmp_path: Path) -> str:
    """Loads a block as what it is; returns its kind. Raises with the reason."""
    data = yaml.safe_load(block.text)
    kind = kind_of(block, data)
    if kind == "sandboxd-config":
        load_daemon_config(block.text, tmp_path)
    elif kind == "policy":
        check_call(call_with(data))
    elif kind == "call":
        check_call(data)
    elif kind == "sandboxctl-config":
        load_client_config(block.text, tmp_path)
    else:
        raise AssertionError(f"{block}: a YAML block that is neither a daemon config, a policy, a call nor a "
                             f"client config (info string {block.kind!r}, keys {sorted(data or {})})")
    return kind


# ------------------------------------------------------------------ the tests

def test_the_docs_have_yaml_examples_of_both_kinds():
    kinds = [kind_of(b, yaml.safe_load(b.text)) for b in yaml_blocks() if b.doc == README]
    assert kinds.count("sandboxd-config") >= 4 and "policy" in kinds, kinds


@pytest.mark.parametrize("block", yaml_blocks(), ids=str)
def test_every_yaml_block_loads_as_what_it_is(block, tmp_path):
    check_block(block, tmp_path)


@pytest.mark.parametrize("text, info, reason", [
    ("principals: {0: root}\nsocket_mode: 660\n", "sandboxd-config", "decimal"),
    ("limits: {default_timeout_ms: 1000, no_such_limit: 1}\n", "sandboxd-config", "no_such_limit"),
    ("dns_servers: [10.0.0.2]\n", "", "neither"),
    ("network: {egress: none, allowDomains: [pypi.org]}\n", "policy", "allowlist"),
    ("process: {maxMemoryMb: 100, maxTmpSizeMb: 100}\n", "policy", "tempDir"),
    ("filesystem: {readRoots: [/etc]}\n", "", "inside /workspace"),
    ("principals: {0: root}\n", "policy", "unknown field"),
    ("filesystem: {}\n", "helm-values", "neither"),
])
def test_a_wrong_example_is_caught(text, info, reason, tmp_path):
    """The checks can fail: a mode in decimal, an unknown key, a fragment out of its
    section, a policy the daemon would refuse, a block marked as what it is not."""
    words = info.split()
    block = Block(README, 1, "yaml", words[0] if words else "", text)
    with pytest.raises(Exception, match=reason):
        check_block(block, tmp_path)


@pytest.mark.parametrize("block", python_blocks(), ids=str)
def test_every_python_block_compiles_and_its_imports_exist(block):
    tree = ast.parse(block.text, str(block))
    compile(tree, str(block), "exec")
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sandboxd"):
            module = importlib.import_module(node.module)
            missing = [a.name for a in node.names if not hasattr(module, a.name)]
            assert not missing, f"{block}: {node.module} has no {missing}"


# ------------------------------------------------------------------ the README's defaults

def defaults_table() -> list[list[str]]:
    section = README.read_text(encoding="utf-8").split("\n## Defaults\n", 1)[1].split("\n## ", 1)[0]
    rows = [line.strip().strip("|").split("|") for line in section.splitlines() if line.startswith("| `")]
    return [[cell.strip() for cell in row] for row in rows]


def first_value(cell: str) -> Any:
    """A cell's value: its leading `literal` (as YAML), else its first number."""
    literal = re.match(r"`([^`]*)`", cell)
    if literal:
        return yaml.safe_load(literal.group(1))
    number = re.search(r"\d+", cell)
    return int(number.group()) if number else None


def test_the_readmes_limits_are_the_codes():
    """Each `limits.default_*` named in a row is the number in its Default column, each
    `limits.max_*` the number in its Maximum column (the CPU maximum, computed, in words)."""
    limits = LimitSettings()
    checked = 0
    for _field, default, maximum, settings in defaults_table():
        for name in re.findall(r"`limits\.(\w+)`", settings):
            cell = default if name.startswith("default_") else maximum
            if name == "max_cpu_millicores":
                assert "1000 × the host's CPUs" in cell
                continue
            assert first_value(cell) == getattr(limits, name), f"README: limits.{name} is {cell!r}"
            checked += 1
    assert checked >= 12


def policy_default(path: str) -> Any:
    """What the daemon applies for a policy field left unset: the resolved (effective)
    policy's value where it has one, else the model's own default."""
    effective = resolve_policy(parse_call(call_with({})), LIMITS, {}).to_json_dict()
    leaf = path.rsplit(".", 1)[-1]
    if leaf in effective:
        return effective[leaf]
    section, _, field = path.partition(".")
    return SandboxPolicy().model_dump(by_alias=True, mode="json")[section][field]


def test_the_readmes_policy_defaults_are_the_codes():
    checked = 0
    for fields, default, _maximum, _settings in defaults_table():
        for path in re.findall(r"`(\w+\.\w+)`", fields):
            expected = policy_default(path)
            if expected is None:  # "the daemon's default": the limits test checks it
                continue
            if isinstance(expected, dict):  # injectedEnv: the row names the whole environment
                env = resolve_policy(parse_call(call_with({})), LIMITS, {}).env
                assert all(name in default for name in env), f"README: {path}: {default!r} lacks some of {env}"
            else:
                assert first_value(default) == expected, f"README: {path} is {default!r}, the code's {expected!r}"
            checked += 1
    assert checked >= 12
