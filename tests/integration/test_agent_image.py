"""The image agents expect (sandboxd/default, images/default/packages), for real on both
backends: its tools are there, `pip install` into a venv and `npm install` fetch from a
package index of the test's own through the daemon's allowlist proxy (and only through
it: another allowlist gets nothing), and what they installed runs. The minimal image
(sandboxd/minimal) has no pip: the same install fails there, so this test can fail.

The index is a server in a network namespace the test makes (package_index.py), under
the name registry.test, which the daemon's egress `hosts` setting maps to it: pip over
HTTPS (a CONNECT tunnel, the index's own certificate given to pip), npm over HTTP."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

import pytest

from sandboxd_testing import make_daemon

from .conftest import BACKENDS, DAEMON_ENV, DEFAULT_IMAGE, AdapterClient, call, public_tmpdir, sh, stop_and_clean
from .package_index import PackageIndexHost, build_wheel, publish_npm, publish_wheel

AGENT_IMAGE = DEFAULT_IMAGE
MINIMAL_IMAGE = "sandboxd/minimal:latest"
DOMAIN = "registry.test"
PACKAGE = "sbxd-hello"
WHEEL_VERSION, NPM_VERSION = "1.0", "1.0.0"
INSTALL_TIMEOUT_MS = 180_000

PY_MODULE = '''\
def greet(who):
    return f"hello {who} from the wheel"


def main():
    print(greet("script"))
'''
NPM_INDEX = 'exports.greet = (who) => `hello ${who} from the tarball`;\n'
NPM_BIN = '#!/usr/bin/env node\nconsole.log(require("./index.js").greet("bin"));\n'

PIP_INSTALL = (f"--disable-pip-version-check --no-input --retries 0 --timeout 30 "
               f"--index-url https://{DOMAIN}/simple/ --cert /workspace/registry.pem {PACKAGE}")
NPM_INSTALL = (f"--registry http://{DOMAIN}/ --no-audit --no-fund --no-update-notifier --fetch-retries 0 "
               f"{PACKAGE}")


@pytest.fixture(scope="module")
def index():
    workdir = public_tmpdir("sandboxd-pkg-index-")
    host = PackageIndexHost(workdir, DOMAIN).start()
    wheel = build_wheel(workdir, PACKAGE, WHEEL_VERSION, "sbxd_hello", PY_MODULE, PACKAGE)
    publish_wheel(host.root, PACKAGE, wheel)
    publish_npm(host.root, f"http://{DOMAIN}/", PACKAGE, NPM_VERSION, NPM_INDEX, NPM_BIN)
    yield host
    host.stop()
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def agent_daemon(docker_engine, index):
    if docker_engine is not None:
        try:
            docker_engine.images.get(MINIMAL_IMAGE)
        except Exception:  # noqa: BLE001 - a missing image is a failure, never a skip
            pytest.fail(f"image {MINIMAL_IMAGE} is missing; run `make images` (images/build.sh minimal)")
    base = public_tmpdir("sandboxd-agent-image-")
    d = make_daemon(base, env=DAEMON_ENV, egress=index.daemon_egress_settings()).start()
    yield d
    stop_and_clean(d, docker_engine, base)


@pytest.fixture(params=BACKENDS)
def ac(agent_daemon, request):
    c = AdapterClient(str(agent_daemon.socket), request.param)
    yield c
    c.close()


@pytest.fixture
def ws(agent_daemon, index) -> Path:
    return agent_daemon.new_workspace({"registry.pem": index.cert.read_text()})


def policy(*domains: str) -> dict:
    """The workspace writable, the index's name (or others) the one way out."""
    return {"filesystem": {"writeRoots": ["/workspace"]},
            "network": {"egress": "allowlist", "allowDomains": list(domains)},
            "process": {"timeoutMs": INSTALL_TIMEOUT_MS}}


def run(client, ws, script: str, pol: dict, image: str = AGENT_IMAGE):
    return client.run(call(ws, sh(textwrap.dedent(script)), pol, runtime={"image": image}),
                      timeout_s=INSTALL_TIMEOUT_MS / 1000 + 60)


def network_records(client, tool_call_id: str) -> list[dict]:
    return [json.loads(e.payload_json) for e in client.get_trace(tool_call_id) if e.type == "NetworkAccessObserved"]


def new_requests(index: PackageIndexHost, before: int) -> list[dict]:
    return index.requests()[before:]


def test_the_default_image_has_the_tools_agents_expect(ac, ws):
    out = run(ac, ws, """
        set -e
        python3 -m pip --version | cut -d' ' -f1
        python3 -c 'import venv, ensurepip; print("venv")'
        node -e 'console.log("node", process.versions.node.split(".")[0] >= 18)'
        npm --version >/dev/null && echo npm
        printf '#include <stdio.h>\\nint main(void) { puts("compiled"); return 0; }\\n' > /workspace/hello.c
        printf 'all:\\n\\tgcc -o /workspace/hello /workspace/hello.c\\n' > /workspace/Makefile
        make -s -C /workspace && /workspace/hello
        rg --no-filename -o 'compiled' /workspace/hello.c
        echo '{"tool": "jq"}' | jq -r .tool
        git --version | cut -d' ' -f1
        curl --version | head -n1 | cut -d' ' -f1
    """, {"filesystem": {"writeRoots": ["/workspace"]}})
    assert out.result.status == "success", (out.stdout, out.stderr)
    assert out.stdout.decode().split() == ["pip", "venv", "node", "true", "npm", "compiled", "compiled", "jq", "git",
                                           "curl"]


def test_pip_installs_into_a_venv_from_the_index_through_the_proxy(ac, ws, index):
    before = len(index.requests())
    out = run(ac, ws, f"""
        set -e
        python3 -m venv /workspace/venv
        /workspace/venv/bin/pip install {PIP_INSTALL}
        /workspace/venv/bin/python -c 'import sbxd_hello; print(sbxd_hello.greet("import"))'
        /workspace/venv/bin/{PACKAGE}
    """, policy(DOMAIN))
    assert out.result.status == "success", (out.stdout, out.stderr)
    lines = out.stdout.decode().splitlines()
    assert f"Successfully installed {PACKAGE}-{WHEEL_VERSION}" in lines
    assert lines[-2:] == ["hello import from the wheel", "hello script from the wheel"]
    # The proxy carried it (a CONNECT tunnel to the index's name, allowed by its rule) ...
    records = network_records(ac, out.tool_call_id)
    assert records and {(r["protocol"], r["host"], r["port"], r["decision"], r["rule"]) for r in records} == {
        ("connect", DOMAIN, 443, "allowed", DOMAIN)}
    assert all(r["address"] == index.address for r in records)
    # ... and the index saw it come from the daemon's side of the link, over TLS.
    seen = new_requests(index, before)
    assert {(r["path"], r["tls"], r["peer"]) for r in seen} >= {
        (f"/simple/{PACKAGE}/", True, index.host_side_address),
        (f"/files/sbxd_hello-{WHEEL_VERSION}-py3-none-any.whl", True, index.host_side_address)}
    assert {r["peer"] for r in seen} == {index.host_side_address}


def test_npm_installs_from_the_registry_through_the_proxy(ac, ws, index):
    before = len(index.requests())
    out = run(ac, ws, f"""
        set -e
        mkdir /workspace/app && cd /workspace/app
        npm install {NPM_INSTALL}
        node -e 'console.log(require("{PACKAGE}").greet("require"))'
        ./node_modules/.bin/{PACKAGE}
    """, policy(DOMAIN))
    assert out.result.status == "success", (out.stdout, out.stderr)
    assert out.stdout.decode().splitlines()[-2:] == ["hello require from the tarball", "hello bin from the tarball"]
    lock = json.loads((ws / "app" / "package-lock.json").read_text())
    assert lock["packages"][f"node_modules/{PACKAGE}"]["resolved"] == \
        f"http://{DOMAIN}/{PACKAGE}/-/{PACKAGE}-{NPM_VERSION}.tgz"
    records = network_records(ac, out.tool_call_id)
    assert records and {(r["protocol"], r["host"], r["port"], r["decision"]) for r in records} == {
        ("http", DOMAIN, 80, "allowed")}
    seen = new_requests(index, before)
    assert {(r["path"], r["tls"], r["host"]) for r in seen} >= {
        (f"/{PACKAGE}", False, DOMAIN), (f"/{PACKAGE}/-/{PACKAGE}-{NPM_VERSION}.tgz", False, DOMAIN)}
    assert {r["peer"] for r in seen} == {index.host_side_address}


def test_an_allowlist_without_the_index_gets_nothing(ac, ws, index):
    before = len(index.requests())
    out = run(ac, ws, f"""
        python3 -m venv /workspace/venv || exit 9
        /workspace/venv/bin/pip install {PIP_INSTALL}
        echo "pip=$?"
        mkdir /workspace/app && cd /workspace/app
        npm install {NPM_INSTALL}
        echo "npm=$?"
    """, policy("other.test"))
    assert out.result.status == "success", (out.stdout, out.stderr)
    assert out.stdout.decode().split()[-2:] == ["pip=1", "npm=1"], (out.stdout, out.stderr)
    assert "403" in out.stderr.decode()
    records = network_records(ac, out.tool_call_id)
    assert records and all(r["host"] == DOMAIN and r["decision"] == "denied" and r["rule"] == "not-allowlisted"
                           for r in records)
    assert {r["protocol"] for r in records} == {"connect", "http"}
    assert new_requests(index, before) == []


def test_the_minimal_image_has_no_pip(ac, ws, index):
    before = len(index.requests())
    out = run(ac, ws, f"""
        python3 -m pip install {PIP_INSTALL}
        echo "pip=$?"
        python3 -m venv /workspace/venv >/dev/null 2>&1
        echo "venv=$?"
        for tool in node npm gcc make rg jq; do command -v $tool || echo "no $tool"; done
    """, policy(DOMAIN), image=MINIMAL_IMAGE)
    assert out.result.status == "success", (out.stdout, out.stderr)
    assert "No module named pip" in out.stderr.decode()
    assert out.stdout.decode().splitlines() == ["pip=1", "venv=1", "no node", "no npm", "no gcc", "no make", "no rg",
                                                "no jq"]
    assert network_records(ac, out.tool_call_id) == [] and new_requests(index, before) == []
