"""The adapters' frameworks are optional extras, imported lazily: the client (and the
adapters package) imports none of them; an adapter imports its own framework only; an
adapter whose framework is missing raises ImportError naming the extra to install, and
one whose framework is there but broken raises the framework's own error. Each case runs
in a fresh interpreter, the missing framework blocked there."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

FRAMEWORKS = {"openai_agents": ("agents", "openai-agents"), "langchain": ("langchain_core", "langchain"),
              "smolagents": ("smolagents", "smolagents")}


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def imported_frameworks(statement: str) -> list[str]:
    tops = json.dumps([top for top, _ in FRAMEWORKS.values()])
    done = run_python(f"import sys, json\n{statement}\n"
                      f"print(json.dumps([m for m in {tops} if m in sys.modules]))")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_client_and_the_adapters_package_import_no_framework():
    assert imported_frameworks("import sandboxd_client") == []
    assert imported_frameworks("import sandboxd_client.adapters, sandboxd_client.adapters.toolkit") == []


@pytest.mark.parametrize("adapter", FRAMEWORKS)
def test_an_adapter_imports_its_own_framework_only(adapter):
    assert imported_frameworks(f"import sandboxd_client.adapters.{adapter}") == [FRAMEWORKS[adapter][0]]


@pytest.mark.parametrize("adapter", FRAMEWORKS)
def test_an_adapter_without_its_framework_names_the_extra(adapter):
    top, extra = FRAMEWORKS[adapter]
    done = run_python(f"import sys\nsys.modules[{top!r}] = None  # as if not installed\n"
                      f"try:\n    import sandboxd_client.adapters.{adapter}\n"
                      f"except ImportError as exc:\n    print(exc.name, '|', exc)\n")
    assert done.returncode == 0, done.stderr
    name, _, message = done.stdout.strip().partition(" | ")
    assert name == top and f"pip install 'sandboxd-client[{extra}]'" in message


def test_a_framework_that_is_there_but_broken_raises_its_own_error():
    # langsmith (a dependency of langchain-core) missing breaks langchain_core's import:
    # that, not "install the extra", is the news.
    done = run_python("import sys\nsys.modules['langsmith'] = None\n"
                      "try:\n    import sandboxd_client.adapters.langchain\n"
                      "except ImportError as exc:\n    print(exc.name, '|', exc)\n")
    assert done.returncode == 0, done.stderr
    name, _, message = done.stdout.strip().partition(" | ")
    assert "langsmith" in message and "sandboxd-client[" not in message
