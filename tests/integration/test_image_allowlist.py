"""The image allowlist holds against references built to slip past it (the red-team's
`sandboxd/../other:latest`, which dockerd cleans into another image, and names the
engine resolves as an image id), on both backends."""

from __future__ import annotations

import io
import tarfile

import pytest

from sandboxd_client import errors

from .conftest import BACKENDS, call, docker_client

OTHER = "probe-other/secret:latest"


@pytest.fixture(scope="module")
def other_image():
    """An image no allowlist of these tests names (one file; it never gets to run)."""
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w") as tar:
        info = tarfile.TarInfo("marker")
        info.size = 6
        tar.addfile(info, io.BytesIO(b"other\n"))
    client = docker_client()
    client.api.import_image_from_data(data.getvalue(), repository="probe-other/secret", tag="latest")
    image_id = client.images.get(OTHER).id
    yield image_id
    client.images.remove(OTHER, force=True)
    client.close()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("image", [
    "sandboxd/../probe-other/secret:latest", "sandboxd/./busybox", "sandboxd//busybox", "sandboxd/busybox\x00",
    "sandboxd/busybox:latest\nx",
])
def test_references_outside_the_grammar_are_refused_by_name(daemon, other_image, backend, image):
    ws = daemon.new_workspace()
    with daemon.client() as c:
        with pytest.raises(errors.InvalidArgument) as exc:
            c.run(call(ws, ["cat", "/marker"], runtime={"adapter": backend, "image": image}))
    assert "runtime.image" in exc.value.message


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_allowed_name_that_resolves_to_another_image_is_refused(spare_daemon, other_image, backend):
    """An operator allowed a bare name; dockerd reads the same string as a prefix of an
    image id. The allowlist is checked on the names of the image it resolved to."""
    short = other_image.split(":", 1)[1][:12]
    d = spare_daemon(allowed_images=["sandboxd/*", f"{short}:*"]).start()
    ws = d.new_workspace()
    with d.client() as c:
        with pytest.raises(errors.PermissionDenied) as exc:
            c.run(call(ws, ["cat", "/marker"], runtime={"adapter": backend, "image": short}))
        assert "probe-other/secret:latest" in exc.value.message and "runtime.image" in exc.value.message
        ok = c.run(call(ws, ["true"], runtime={"adapter": backend, "image": "sandboxd/busybox"}))
        assert ok.result.status == "success"
