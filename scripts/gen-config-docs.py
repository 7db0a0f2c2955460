#!/usr/bin/env python3
"""docs/CONFIGURATION.md and docs/sandboxd-config.schema.json, generated from the daemon's
settings models (daemon/sandboxd/core/settings.py, DaemonSettings and its sections).

Each setting's type and default come from the pydantic model; its meaning from the
comment lines right above it (or the comment at the end of its line) in the source, read
with `tokenize`, so settings.py stays the one place a setting is explained. A setting
with no such comment takes its meaning from UNCOMMENTED below; one with neither stops the
generator, naming it: a new setting is never published undocumented.

Usage: gen-config-docs.py [--check] [--out-dir DIR] [--settings-source FILE]
  --check            write nothing; exit 1 naming each file that differs from what
                     would be generated (the committed docs are stale)
  --out-dir          where the two files are (default: docs/ of this checkout)
  --settings-source  the source to read comments from (default: the imported module's)
"""

from __future__ import annotations

import argparse
import ast
import inspect
import io
import json
import sys
import tokenize
import types
import typing
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from sandboxd.core import assets, settings as settings_module
from sandboxd.core.settings import DaemonSettings

from config_docs_text import INTRO, UNCOMMENTED  # beside this script

CHECKOUT = Path(__file__).resolve().parents[1]
MARKDOWN = "CONFIGURATION.md"
SCHEMA = "sandboxd-config.schema.json"
# Defaults computed when the daemon starts (the host's CPUs, where the package is
# installed): shown as what they are, never as this machine's value.
COMPUTED = {"(os.cpu_count() or 1) * 1000": "1000 × the host's CPU count"}
PLAIN_NAMES = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "Path": "path",
               "FileMode": "octal mode"}
PLURALS = {"string": "strings", "integer": "integers", "path": "paths", "number": "numbers"}


@dataclass(frozen=True)
class Setting:
    """One field of a settings model as the source spells it."""

    name: str
    annotation: ast.expr
    default: ast.expr | None  # the default's expression or its default_factory; None: required
    meaning: str


@dataclass(frozen=True)
class Section:
    """A settings model and where it sits in the config file ("" for the top level)."""

    path: str
    model: type[BaseModel]
    shape: str  # "" | "optional" | "map"


# ------------------------------------------------------------------ the source's comments

def source_comments(source: str) -> dict[int, tuple[str, bool]]:
    """line -> (comment text without '#', whether the line holds only the comment)."""
    found: dict[int, tuple[str, bool]] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            alone = tok.line[:tok.start[1]].strip() == ""
            found[tok.start[0]] = (tok.string.lstrip("#").strip(), alone)
    return found


def comment_of(node: ast.AnnAssign, comments: dict[int, tuple[str, bool]]) -> str:
    """The comment lines right above a field (no blank line between), then the one at the
    end of its own line(s)."""
    above: list[str] = []
    line = node.lineno - 1
    while line in comments and comments[line][1]:
        above.insert(0, comments[line][0])
        line -= 1
    inline = [comments[n][0] for n in range(node.lineno, (node.end_lineno or node.lineno) + 1)
              if n in comments and not comments[n][1]]
    return " ".join(part for part in above + inline if not part.startswith("noqa"))


def default_expression(value: ast.expr | None) -> ast.expr | None:
    """The expression of a field's default (or of its default_factory); None: required."""
    if not (isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id == "Field"):
        return value
    for kw in value.keywords:
        if kw.arg in ("default", "default_factory"):
            return kw.value
    if value.args and not (isinstance(value.args[0], ast.Constant) and value.args[0].value is Ellipsis):
        return value.args[0]
    return None


def source_settings(source: str) -> dict[str, dict[str, Setting]]:
    """class name -> field name -> Setting, for every class of the module."""
    comments = source_comments(source)
    classes: dict[str, dict[str, Setting]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef):
            continue
        fields: dict[str, Setting] = {}
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            if item.target.id != "model_config":
                fields[item.target.id] = Setting(item.target.id, item.annotation, default_expression(item.value),
                                                 comment_of(item, comments))
        classes[node.name] = fields
    return classes


# ------------------------------------------------------------------ the models' tree

def nested_models(annotation: Any) -> list[type[BaseModel]]:
    """Settings models inside a field's type (`X`, `X | None`, `dict[str, X]`)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in nested_models(arg)]


def sections(model: type[BaseModel] = DaemonSettings, path: str = "") -> list[Section]:
    """The model's section and every section below it, in the order of their fields."""
    found = [Section(path, model, "")]
    for name, info in model.model_fields.items():
        for sub in nested_models(info.annotation):
            sub_path = f"{path}.{name}" if path else name
            below = sections(sub, sub_path)
            origin = typing.get_origin(info.annotation)
            shape = "map" if origin is dict else "optional" if origin in (typing.Union, types.UnionType) else ""
            found.append(Section(sub_path, sub, shape))
            found.extend(below[1:])
    return found


def described(source: dict[str, dict[str, Setting]]) -> dict[str, dict[str, Setting]]:
    """section path -> field -> Setting with its meaning; refuses (SystemExit, naming
    each) a setting with no meaning and an UNCOMMENTED entry that a comment made stale."""
    problems: list[str] = []
    out: dict[str, dict[str, Setting]] = {}
    used: set[str] = set()
    for section in sections():
        fields = source.get(section.model.__name__, {})
        out[section.path] = {}
        for name in section.model.model_fields:
            key = f"{section.path}.{name}" if section.path else name
            setting = fields.get(name)
            if setting is None:
                problems.append(f"{key}: not found in the settings source")
                continue
            extra = UNCOMMENTED.get(key)
            if extra is not None:
                used.add(key)
                if setting.meaning:
                    problems.append(f"{key}: settings.py now explains it; delete its UNCOMMENTED entry")
                setting = replace(setting, meaning=extra)
            models = nested_models(section.model.model_fields[name].annotation)
            if not setting.meaning and models and models[0].__doc__:  # a section: its docstring
                setting = replace(setting, meaning=" ".join(models[0].__doc__.split()))
            if not setting.meaning:
                problems.append(f"{key}: no meaning: add a comment above it in daemon/sandboxd/core/settings.py")
            out[section.path][name] = setting
    problems += [f"{key}: an UNCOMMENTED entry for no setting" for key in sorted(set(UNCOMMENTED) - used)]
    if problems:
        raise SystemExit("gen-config-docs: settings without a meaning:\n  " + "\n  ".join(problems))
    return out


# ------------------------------------------------------------------ types and defaults

def type_text(node: ast.expr, plural: bool = False) -> str:
    """A field's type in a reader's words: `tuple[str, ...]` is "list of strings"."""
    if isinstance(node, ast.Constant) and node.value is None:
        return "null"
    if isinstance(node, ast.Name):
        model = getattr(settings_module, node.id, None)
        if isinstance(model, type) and issubclass(model, BaseModel):
            return "sections" if plural else "section"
        word = PLAIN_NAMES.get(node.id, node.id)
        return PLURALS.get(word, word + "s") if plural else word
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        left, right = type_text(node.left, plural), type_text(node.right, plural)
        return f"{left}, or null" if right == "null" else f"{left} or {right}"
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        args = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if node.value.id in ("tuple", "list"):
            return ("lists" if plural else "list") + " of " + type_text(args[0], plural=True)
        if node.value.id == "dict":
            return ("maps" if plural else "map") + f" of {type_text(args[0])} → {type_text(args[1])}"
    return ast.unparse(node)


def is_computed(node: ast.expr) -> bool:
    """Whether a default depends on the host or the installation (a call of anything but Path)."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and not (isinstance(sub.func, ast.Name) and sub.func.id in ("Path", "Field")):
            return True
        if isinstance(sub, ast.Attribute):
            return True
    return False


def computed_text(node: ast.expr) -> str:
    """A host- or install-dependent default in words: never this machine's value."""
    body = node.body if isinstance(node, ast.Lambda) else node
    if (isinstance(body, ast.Call) and isinstance(body.func, ast.Name) and body.func.id == "packaged"
            and isinstance(body.args[0], ast.Name)):
        return f"`<sandboxd>/assets/{getattr(assets, body.args[0].id)}`"
    source = ast.unparse(body)
    return COMPUTED.get(source, f"`{source}` (computed at start)")


def plain(value: Any) -> Any:
    """A default as the config file would spell it (paths as strings, tuples as lists)."""
    if isinstance(value, BaseModel):
        return {k: plain(v) for k, v in value}
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def yaml_flow(value: Any) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip().removesuffix("\n...").strip()


def is_mode(setting: Setting) -> bool:
    return isinstance(setting.annotation, ast.Name) and setting.annotation.id == "FileMode"


def default_value(model: type[BaseModel], name: str) -> Any:
    info = model.model_fields[name]
    return info.get_default(call_default_factory=True)


def default_text(model: type[BaseModel], setting: Setting) -> str:
    """The default as a table cell."""
    info = model.model_fields[setting.name]
    if info.default is PydanticUndefined and info.default_factory is None:
        return "required"
    if setting.default is not None and is_computed(setting.default):
        return computed_text(setting.default)
    value = default_value(model, setting.name)
    if isinstance(value, BaseModel):
        return "(section)"
    if is_mode(setting):
        return f"`{value:#o}`"
    text = f"`{yaml_flow(plain(value))}`"
    if setting.name.endswith("_bytes") and isinstance(value, int) and value >= 1024 and value % 1024 == 0:
        text += " (" + size_text(value) + ")"
    return text


def size_text(value: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value % size == 0:
            return f"{value // size} {unit}"
    return f"{value} bytes"


def bounds_text(model: type[BaseModel], name: str) -> str:
    """A field's bounds (`Field(ge=..., le=...)`) in words, or ""."""
    low = high = ""
    for item in model.model_fields[name].metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">")):
            if getattr(item, attr, None) is not None:
                low = f"{sign} {getattr(item, attr)}"
        for attr, sign in (("le", "≤"), ("lt", "<")):
            if getattr(item, attr, None) is not None:
                high = f"{sign} {getattr(item, attr)}"
    return ", ".join(part for part in (low, high) if part)


# ------------------------------------------------------------------ CONFIGURATION.md

def sentence(text: str) -> str:
    """A meaning on one line, ending like a sentence."""
    text = " ".join(text.split())
    return text if text.endswith((".", ")", "!", "?")) else text + "."


def escape(text: str) -> str:
    return sentence(text).replace("|", "\\|")


def section_markdown(section: Section, settings: dict[str, Setting]) -> list[str]:
    lines = [f"## {section.path or 'Top level'}", ""]
    doc = " ".join((section.model.__doc__ or "").split()) if section.path else ""
    if section.shape == "map":
        doc = f"A map of id → this section. {doc}"
    elif section.shape == "optional":
        doc = f"Optional: unset (the default) means none. {doc}"
    if doc.strip():
        lines += [doc.strip(), ""]
    lines += ["| Setting | Type | Default | Meaning |", "|---|---|---|---|"]
    for name, setting in settings.items():
        kind = type_text(setting.annotation)
        bounds = bounds_text(section.model, name)
        if nested_models(section.model.model_fields[name].annotation):
            sub = f"{section.path}.{name}" if section.path else name
            kind = f"[{kind}](#{sub})"
        lines.append(f"| `{name}` | {kind}{' (' + bounds + ')' if bounds else ''} | "
                     f"{default_text(section.model, setting)} | {escape(setting.meaning)} |")
    return lines + [""]


def defaults_yaml(model: type[BaseModel], settings: dict[str, dict[str, Setting]], path: str = "",
                  indent: str = "") -> list[str]:
    """Every setting at its default, as a config file spells it; host- or install-dependent
    defaults (and the optional sections) as comments."""
    lines: list[str] = []
    for name, setting in settings[path].items():
        info = model.model_fields[name]
        sub_path = f"{path}.{name}" if path else name
        sub_models = nested_models(info.annotation)
        if sub_models and isinstance(default_value(model, name), BaseModel):
            lines.append(f"{indent}{name}:")
            lines += defaults_yaml(sub_models[0], settings, sub_path, indent + "  ")
        elif sub_models and default_value(model, name) is None:
            lines.append(f"{indent}# {name}: unset (see the {sub_path} section)")
        elif setting.default is not None and is_computed(setting.default):
            lines.append(f"{indent}# {name}: {computed_text(setting.default).strip('`')}")
        elif is_mode(setting):
            lines.append(f"{indent}{name}: {default_value(model, name):#o}")
        else:
            lines.append(f"{indent}{name}: {yaml_flow(plain(default_value(model, name)))}")
    return lines


def markdown(settings: dict[str, dict[str, Setting]]) -> str:
    parts = [INTRO, "## Sections", ""]
    for section in sections():
        label = section.path or "Top level"
        parts.append(f"- [{label}](#{section.path or 'top-level'})")
    parts += ["- [Every setting at its default](#every-setting-at-its-default)", ""]
    for section in sections():
        parts += section_markdown(section, settings[section.path])
    parts += ["## Every setting at its default", "",
              "As a file (commented: what depends on the host or the installation, and the optional "
              "sections). Copying it whole pins today's defaults; a file should hold only what it changes.",
              "", "```yaml sandboxd-config"]
    parts += defaults_yaml(DaemonSettings, settings)
    parts += ["```", ""]
    return "\n".join(parts)


# ------------------------------------------------------------------ the JSON schema

MODE_SCHEMA = {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 0o777},
                         {"type": "string", "pattern": "^0[oO]?[0-7]{1,3}$"}]}


def property_schema(prop: dict[str, Any], model: type[BaseModel], setting: Setting) -> dict[str, Any]:
    """A field's schema with its meaning, and the defaults pydantic leaves out or gets
    from this machine put right."""
    prop = dict(prop)
    info = model.model_fields[setting.name]
    prop["description"] = sentence(setting.meaning)
    if setting.default is not None and is_computed(setting.default):
        prop.pop("default", None)
        prop["description"] += f" Default: {computed_text(setting.default).strip('`')}."
    elif info.default_factory is not None and not isinstance(default_value(model, setting.name), BaseModel):
        prop["default"] = plain(default_value(model, setting.name))
    if is_mode(setting):
        prop = {**{k: v for k, v in prop.items() if k != "type"}, **MODE_SCHEMA}
    annotation = setting.annotation
    if (isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name)
            and annotation.value.id == "dict" and isinstance(annotation.slice, ast.Tuple)
            and isinstance(annotation.slice.elts[0], ast.Name) and annotation.slice.elts[0].id == "int"):
        prop["propertyNames"] = {"pattern": "^[0-9]+$"}
    return prop


def schema(settings: dict[str, dict[str, Setting]]) -> dict[str, Any]:
    raw = DaemonSettings.model_json_schema()
    for section in sections():
        target = raw if not section.path else raw["$defs"][section.model.__name__]
        if section.path:
            target["description"] = " ".join((section.model.__doc__ or "").split())
        for name, setting in settings[section.path].items():
            target["properties"][name] = property_schema(target["properties"][name], section.model, setting)
    head = {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "sandboxd daemon settings",
            "description": "The YAML file `sandboxd --config` reads (docs/CONFIGURATION.md)."}
    return {**head, **{k: v for k, v in raw.items() if k not in head}}


# ------------------------------------------------------------------ main

def section_sources(source_path: Path) -> dict[str, dict[str, Setting]]:
    """The settings source's classes, and those of the other modules a section is
    defined in (core/artifact_settings.py)."""
    found = source_settings(source_path.read_text(encoding="utf-8"))
    for path in sorted({inspect.getsourcefile(s.model) or "" for s in sections()} - {"", str(source_path)}):
        if Path(path).resolve() != Path(settings_module.__file__).resolve():
            found = {**source_settings(Path(path).read_text(encoding="utf-8")), **found}
    return found


def generated(source_path: Path) -> dict[str, str]:
    settings = described(section_sources(source_path))
    return {MARKDOWN: markdown(settings),
            SCHEMA: json.dumps(schema(settings), indent=2, ensure_ascii=False) + "\n"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the files are stale; write nothing")
    parser.add_argument("--out-dir", type=Path, default=CHECKOUT / "docs")
    parser.add_argument("--settings-source", type=Path, default=Path(settings_module.__file__))
    args = parser.parse_args(argv)
    files = generated(args.settings_source)
    if args.check:
        stale = [name for name, text in files.items()
                 if not (args.out_dir / name).is_file() or (args.out_dir / name).read_text(encoding="utf-8") != text]
        for name in stale:
            print(f"gen-config-docs: {args.out_dir / name} is stale: run scripts/gen-config-docs.py", file=sys.stderr)
        return 1 if stale else 0
    for name, text in files.items():
        (args.out_dir / name).write_text(text, encoding="utf-8")
        print(f"wrote {args.out_dir / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
