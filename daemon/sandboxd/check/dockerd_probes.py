"""`sandboxd check`'s probes of dockerd (the docker_host setting): that it answers, its
version and API, its cgroup driver and whether the Docker backend supports it, and the
images calls would run in (default_image, and the local images allowed_images lets
calls name). Reads only: nothing is pulled, made or removed. The SDK's errors are
translated by backends/docker/errors.py, as everywhere."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sandboxd.backends.docker.compile import CGROUP_DRIVERS
from sandboxd.backends.docker.errors import dockerd
from sandboxd.check.report import Finding
from sandboxd.core.artifact_settings import mask_userinfo
from sandboxd.core.errors import BackendUnavailable, FailedPrecondition, SandboxdError
from sandboxd.core.settings import DaemonSettings
from sandboxd.policy import images

DEFAULT_DOCKER_HOST = "unix:///var/run/docker.sock"
# dockerd 20.10: the Docker backend's oldest (its API calls and the cgroup v2 support).
MIN_API_VERSION = (1, 41)
# Each Docker sandbox gets a parent cgroup of its own: /sandboxd/<sandbox id> under the
# cgroupfs driver, the slice sandboxd-<sandbox id>.slice under systemd's.
SUPPORTED_CGROUP_DRIVERS = CGROUP_DRIVERS
CHECK_TIMEOUT_S = 10
_SHOWN_IMAGES = 5


@dataclass(frozen=True)
class DockerFacts:
    """What dockerd said about itself and its images."""

    version: dict[str, Any]
    info: dict[str, Any]
    image_tags: tuple[str, ...]  # every local image's names
    default_image_id: str | None  # None: default_image is not in dockerd


def ask_dockerd(settings: DaemonSettings) -> DockerFacts:
    """dockerd's version, info and images (BackendUnavailable when it does not answer)."""
    import docker  # heavy; only when dockerd is asked

    base_url = settings.docker_host or DEFAULT_DOCKER_HOST
    with dockerd(f"answer at {mask_userinfo(base_url)}", refusal=BackendUnavailable):
        api = docker.APIClient(base_url=base_url, version="auto", timeout=CHECK_TIMEOUT_S)
    try:
        with dockerd("tell its version and images", refusal=BackendUnavailable):
            version, info = api.version(), api.info()
            tags = tuple(t for image in api.images() for t in (image.get("RepoTags") or ()) if t != "<none>:<none>")
        default_id: str | None = None
        try:
            with dockerd("inspect the default image", refusal=FailedPrecondition, image=settings.default_image):
                default_id = str(api.inspect_image(settings.default_image)["Id"])
        except FailedPrecondition:
            pass  # not there (or no image reference): image_finding says which
        return DockerFacts(version, info, tags, default_id)
    finally:
        api.close()


def docker_findings(settings: DaemonSettings) -> list[Finding]:
    """dockerd, its cgroup driver, the images."""
    base_url = mask_userinfo(settings.docker_host or DEFAULT_DOCKER_HOST)  # as shown: never a user:password@
    try:
        facts = ask_dockerd(settings)
    except SandboxdError as exc:
        return [Finding("dockerd", "fail", f"dockerd at {base_url} does not answer ({mask_userinfo(exc.reason)}): "
                                           "is it running? (`make docker` starts one)", needed_by=("docker",),
                        field="docker_host"),
                Finding("images", "fail", "not checked: dockerd does not answer (jails run only images exported "
                                          "from it before)", needed_by=("docker",))]
    return [_version_finding(base_url, facts), _driver_finding(facts), image_finding(settings, facts)]


def _api_version(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(p) for p in text.split("."))
    except ValueError:
        return ()


def _version_finding(base_url: str, facts: DockerFacts) -> Finding:
    server, api = facts.version.get("Version", "?"), str(facts.version.get("ApiVersion", ""))
    told = f"dockerd at {base_url} answers: Docker {server}, API {api}"
    if _api_version(api) < MIN_API_VERSION:
        oldest = ".".join(map(str, MIN_API_VERSION))
        return Finding("dockerd", "fail", f"{told}; the Docker backend needs API {oldest} (Docker 20.10) or newer",
                       needed_by=("docker",))
    return Finding("dockerd", "ok", told, needed_by=("docker",))


def _driver_finding(facts: DockerFacts) -> Finding:
    driver = str(facts.info.get("CgroupDriver", "unknown"))
    told = f"dockerd's cgroup driver is {driver} (cgroup v{facts.info.get('CgroupVersion', '?')})"
    if driver in SUPPORTED_CGROUP_DRIVERS:
        return Finding("docker-cgroup-driver", "ok", f"{told}: supported", needed_by=("docker",))
    return Finding("docker-cgroup-driver", "fail",
                   f"{told}, which the Docker backend does not support: run dockerd with exec-opts "
                   "native.cgroupdriver=systemd (or cgroupfs)",
                   needed_by=("docker",))


def image_finding(settings: DaemonSettings, facts: DockerFacts) -> Finding:
    """default_image must be in dockerd under a name allowed_images allows (calls that
    name no image run in it); the other local images calls may name are listed."""
    default, patterns = settings.default_image, settings.allowed_images
    allowed = sorted(t for t in facts.image_tags if images.allowed(t, patterns))
    shown = ", ".join(allowed[:_SHOWN_IMAGES]) + (f" and {len(allowed) - _SHOWN_IMAGES} more"
                                                  if len(allowed) > _SHOWN_IMAGES else "")
    both = ("docker", "nsjail")
    try:
        name = images.parse_reference(default).name
    except SandboxdError as exc:
        return Finding("images", "fail", exc.reason, needed_by=both, field="default_image")
    if facts.default_image_id is None:
        return Finding("images", "fail", f"{default} is not in dockerd (nothing is pulled: build it with "
                                         "`make images`, images/build.sh)", needed_by=both, field="default_image")
    if not images.allowed(name, patterns):
        return Finding("images", "fail", f"{default} is not allowed by allowed_images ({', '.join(patterns)}): "
                                         "every call that names no image would be refused",
                       needed_by=both, field="default_image")
    return Finding("images", "ok", f"{default} is present ({facts.default_image_id[:19]}); allowed local images: "
                                   f"{shown}", needed_by=both)
