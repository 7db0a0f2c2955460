"""docs/CONFIGURATION.md and docs/sandboxd-config.schema.json are generated from the
settings models (scripts/gen-config-docs.py): they must be current, name every setting,
and a setting nobody explained must stop the generator."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel

from sandboxd.core import settings as settings_module
from sandboxd.core.settings import DaemonSettings

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gen-config-docs.py"
DOCS = ROOT / "docs"
MARKDOWN = "CONFIGURATION.md"
SCHEMA = "sandboxd-config.schema.json"


def generator(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=120)


def settings_tree(model: type[BaseModel] = DaemonSettings, path: str = "") -> dict[str, set[str]]:
    """section path -> its field names, for DaemonSettings and every model inside it."""
    tree = {path: set(model.model_fields)}
    for name, info in model.model_fields.items():
        for sub in _models(info.annotation):
            tree.update(settings_tree(sub, f"{path}.{name}" if path else name))
    return tree


def _models(annotation) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in getattr(annotation, "__args__", ()) for m in _models(arg)]


def test_the_committed_docs_are_current():
    result = generator("--check")
    assert result.returncode == 0, result.stderr + "\nrun: .venv/bin/python scripts/gen-config-docs.py"


def test_a_stale_file_is_caught(tmp_path):
    for name in (MARKDOWN, SCHEMA):
        shutil.copy(DOCS / name, tmp_path / name)
    assert generator("--check", "--out-dir", str(tmp_path)).returncode == 0
    for name, old, new in ((MARKDOWN, "| `default_timeout_ms` | integer | `60000` |",
                            "| `default_timeout_ms` | integer | `30000` |"),
                           (SCHEMA, '"default": 60000', '"default": 30000')):
        text = (tmp_path / name).read_text()
        assert old in text
        (tmp_path / name).write_text(text.replace(old, new))
        result = generator("--check", "--out-dir", str(tmp_path))
        assert result.returncode == 1 and f"{name} is stale" in result.stderr
        (tmp_path / name).write_text(text)
    (tmp_path / SCHEMA).unlink()
    result = generator("--check", "--out-dir", str(tmp_path))
    assert result.returncode == 1 and f"{SCHEMA} is stale" in result.stderr


def test_a_setting_without_a_meaning_stops_the_generator(tmp_path):
    """Its comment removed from a copy of settings.py: the generator names the setting
    and where to explain it, and writes nothing."""
    source = Path(settings_module.__file__).read_text()
    comment = "    # The loopback port the sandbox's HTTP(S)_PROXY points at.\n"
    assert comment in source
    copy = tmp_path / "settings.py"
    copy.write_text(source.replace(comment, ""))
    result = generator("--out-dir", str(tmp_path), "--settings-source", str(copy))
    assert result.returncode != 0
    assert "egress.proxy_port: no meaning" in result.stderr and "settings.py" in result.stderr
    assert not (tmp_path / MARKDOWN).exists()


def test_every_setting_has_a_row_with_a_meaning():
    text = (DOCS / MARKDOWN).read_text()
    documented: dict[str, set[str]] = {}
    for title, body in re.findall(r"^## (.+?)\n(.*?)(?=^## |\Z)", text, flags=re.M | re.S):
        rows = re.findall(r"^\| `(\w+)` \|[^|]+\|[^|]+\| (.+?) \|$", body, flags=re.M)
        assert all(meaning.strip() for _name, meaning in rows)
        if rows:
            documented["" if title == "Top level" else title] = {name for name, _ in rows}
    assert documented == settings_tree()


def test_the_schema_describes_every_setting_and_forbids_unknown_ones():
    schema = json.loads((DOCS / SCHEMA).read_text())
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    models = [schema, *schema["$defs"].values()]
    assert len(models) == len(settings_tree())
    for model in models:
        assert model["additionalProperties"] is False
        assert all(prop.get("description") for prop in model["properties"].values()), model.get("title")
    # Nothing of this machine: the CPU maximum and the packaged paths have no default.
    limits = schema["$defs"]["LimitSettings"]["properties"]["max_cpu_millicores"]
    assert "default" not in limits and "CPU count" in limits["description"]
    assert "default" not in schema["properties"]["shim_binary"]
    assert schema["properties"]["principals"]["default"] == {"0": "root"}
    assert {"type": "string", "pattern": "^0[oO]?[0-7]{1,3}$"} in schema["properties"]["socket_mode"]["anyOf"]
