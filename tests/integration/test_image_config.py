"""What an image's own config could add to a call, on Docker: an ENTRYPOINT ran before
the shim (so before the file-access watch) with the call's argv as its arguments, and an
ENV reached every sandbox's environment. The call runs its argv alone, and an image
whose ENV would reach the sandbox is refused by name."""

from __future__ import annotations

import pytest

from sandboxd_client import errors

from .conftest import BUSYBOX_IMAGE, call, docker_client

ENTRYPOINT_IMAGE = "sandboxd/probe-entrypoint:latest"
ENV_IMAGE = "sandboxd/probe-env:latest"


@pytest.fixture(scope="module")
def probe_images(docker_engine):
    client = docker_client()
    base = client.containers.create(BUSYBOX_IMAGE, ["true"])
    try:
        base.commit("sandboxd/probe-entrypoint", "latest",
                    changes=['ENTRYPOINT ["/bin/echo", "entrypoint-ran"]'])
        base.commit("sandboxd/probe-env", "latest", changes=["ENV LD_PRELOAD=/nonexistent.so"])
    finally:
        base.remove(force=True)
    yield
    for image in (ENTRYPOINT_IMAGE, ENV_IMAGE):
        client.images.remove(image, force=True)
    client.close()


def test_an_image_entrypoint_never_runs(daemon, probe_images):
    ws = daemon.new_workspace()
    with daemon.client() as c:
        out = c.run(call(ws, ["echo", "argv-alone"], runtime={"adapter": "docker", "image": ENTRYPOINT_IMAGE}))
    assert out.result.status == "success" and out.stdout == b"argv-alone\n", (out.result, out.stdout)


def test_an_image_whose_env_would_reach_the_sandbox_is_refused(daemon, probe_images):
    ws = daemon.new_workspace()
    with daemon.client() as c:
        with pytest.raises(errors.FailedPrecondition) as exc:
            c.run(call(ws, ["env"], runtime={"adapter": "docker", "image": ENV_IMAGE}))
    assert "LD_PRELOAD" in exc.value.message and "runtime.image" in exc.value.message
