"""The Docker SDK's exceptions, and its transport's (requests), translated into the
daemon's here and nowhere else: no caller above the backends ever sees one. Used by the
Docker backend and by nsjail's image export, the other talker to dockerd. (The SDK is
imported when a call is made, never at import: it is heavy.)"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import requests

from sandboxd.core.errors import BackendUnavailable, FailedPrecondition, InternalError, SandboxdError

# dockerd's answers that may mean a job is done already: no such object, and not in
# that state any more (a container not running, a removal under way).
NOT_FOUND = 404
CONFLICT = 409


class EngineRefused(Exception):
    """dockerd's refusal, handed to a caller that judges it itself (`refusal=None`):
    a removal already under way is no failure. Never leaves the backend."""

    def __init__(self, status_code: int | None, explanation: str):
        super().__init__(explanation)
        self.status_code = status_code
        self.explanation = explanation


def _unreachable(exc: BaseException) -> BackendUnavailable:
    """dockerd gone or unreachable (refused, reset, timed out): never a bare transport error."""
    return BackendUnavailable(f"dockerd did not answer: {type(exc).__name__}")


@contextlib.contextmanager
def dockerd(doing: str, *, refusal: type[SandboxdError] | None = InternalError, image: str = "") -> Iterator[None]:
    """One conversation with dockerd. Its refusal becomes `refusal` ("dockerd failed to
    <doing>: <its explanation>"), or with None an EngineRefused for the caller to judge;
    an image it does not have (`image` named) becomes FailedPrecondition; no answer at
    all becomes BackendUnavailable."""
    import docker.errors  # heavy; loaded once the backend is in use

    try:
        yield
    except docker.errors.APIError as exc:
        if image and isinstance(exc, docker.errors.ImageNotFound):
            raise FailedPrecondition(f"image {image!r} is not present in the local engine (nothing is pulled; "
                                     "build it with images/build.sh)", field="runtime.image") from None
        if refusal is None:
            raise EngineRefused(exc.status_code, str(exc.explanation)) from None
        raise refusal(f"dockerd failed to {doing}: {exc.explanation}") from None
    except (requests.exceptions.RequestException, ConnectionError) as exc:
        raise _unreachable(exc) from None
    except docker.errors.DockerException as exc:  # the SDK's own root: a client it cannot make
        raise BackendUnavailable(f"cannot reach dockerd: {exc}") from None
