# sandboxd: `make run` starts the daemon, `make test` runs the whole suite. Both install
# what is missing first (venv, Debian's docker.io with a started dockerd, images).
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=
# The native helpers are built into the package, where the daemon finds them (core/assets.py).
ASSETS := daemon/sandboxd/assets

.PHONY: run test unit integration lint venv docker images native proto proto-check bench clean cgroup2-vm wheels docs

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(VENV)/bin/pip install -q --disable-pip-version-check -e '.[dev]'
	touch $(STAMP)

venv: $(STAMP)

# The sandbox shim runs inside every image, so it is static and libc-only.
$(ASSETS)/sandbox-shim: native/sandbox-shim.c
	@mkdir -p $(ASSETS)
	@command -v gcc >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q gcc libc6-dev
	set -o pipefail; gcc -static -O2 -Wall -Wextra -o $@ $< 2>&1 | { grep -v 'statically linked' || true; }

# File-access recording's event reader, loaded by the daemon with ctypes.
$(ASSETS)/libsandboxd-fanotify.so: native/fanotify-reader.c
	@mkdir -p $(ASSETS)
	@command -v gcc >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q gcc libc6-dev
	gcc -shared -fPIC -O2 -Wall -Wextra -o $@ $< -lpthread

# The peer-credential relay's byte pump, loaded by the daemon with ctypes.
$(ASSETS)/libsandboxd-relay.so: native/relay.c
	@mkdir -p $(ASSETS)
	@command -v gcc >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q gcc libc6-dev
	gcc -shared -fPIC -O2 -Wall -Wextra -o $@ $< -lpthread

# Starts nsjail inside a sandbox's cgroup on cgroup v2 (joins it, then execs).
$(ASSETS)/sandboxd-cgroup-exec: native/cgroup-exec.c
	@mkdir -p $(ASSETS)
	@command -v gcc >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q gcc libc6-dev
	set -o pipefail; gcc -static -O2 -Wall -Wextra -o $@ $< 2>&1 | { grep -v 'statically linked' || true; }

native: $(ASSETS)/sandbox-shim $(ASSETS)/libsandboxd-fanotify.so $(ASSETS)/libsandboxd-relay.so $(ASSETS)/sandboxd-cgroup-exec

docker:
	scripts/ensure-docker.sh

images: docker
	images/build.sh default
	images/build.sh minimal
	images/build.sh busybox

proto: venv
	PYTHON=$(PY) scripts/gen-proto.sh

proto-check: venv
	PYTHON=$(PY) scripts/gen-proto.sh --check

run: venv images native
	scripts/demo-workspace.sh >/dev/null
	$(VENV)/bin/sandboxd $(if $(CONFIG),--config $(CONFIG))

# The three wheels (docs/INSTALL.md), checked against each other, into dist/.
wheels: venv native
	PYTHON=$(PY) scripts/build-wheels.sh dist

# docs/CONFIGURATION.md and its JSON schema, from core/settings.py.
docs: venv
	$(PY) scripts/gen-config-docs.py

unit: venv native
	$(VENV)/bin/pytest -q tests/unit $(PYTEST_ARGS)

integration: venv images native cgroup2-vm
	$(VENV)/bin/pytest -q tests/integration $(PYTEST_ARGS)

# The cgroup v2 host of tests/integration/test_cgroup_v2.py: qemu, Debian's kernel
# (downloaded, never installed) and the guest's initramfs, cached by content.
cgroup2-vm:
	scripts/cgroup2-vm/run.sh --prepare

# The daemon's layers (the import contract in pyproject.toml) and its types (mypy).
lint: venv
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy

test: venv lint images native proto-check cgroup2-vm
	$(VENV)/bin/pytest -q tests $(PYTEST_ARGS)

$(VENV)/.bench-stamp: pyproject.toml $(STAMP)
	$(VENV)/bin/pip install -q --disable-pip-version-check -e '.[dev,bench]'
	touch $@

bench: venv images native $(VENV)/.bench-stamp
	$(PY) bench/cold_start.py
	$(PY) bench/stream_throughput.py
	$(PY) bench/egress_proxy.py
	$(PY) bench/audit_query.py
	$(PY) bench/warm_exec.py
	$(PY) bench/file_access.py
	$(PY) bench/installed_wheel.py
	$(PY) bench/artifact_store.py

clean:
	rm -rf $(VENV) build dist *.egg-info $(ASSETS)/sandbox-shim $(ASSETS)/*.so $(ASSETS)/sandboxd-cgroup-exec
