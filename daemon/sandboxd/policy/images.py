"""Image references and the daemon's image allowlist (pure). A reference is parsed with
the Docker reference grammar (no `..`, no empty component, nothing but its alphabet),
and an allowlist pattern's `*` never crosses a `/`: `sandboxd/*` names the images of
the sandboxd repository and nothing a path could reach from there. The allowlist is
checked twice: on the name a call gives, and on the names the engine resolved it to."""

from __future__ import annotations

import re
from dataclasses import dataclass

from sandboxd.core.errors import InvalidArgument

FIELD = "runtime.image"
MAX_REFERENCE_CHARS = 255
_ALNUM = r"[a-z0-9]+"
_SEPARATOR = r"(?:[._]|__|-+)"
_PATH_COMPONENT = rf"{_ALNUM}(?:{_SEPARATOR}{_ALNUM})*"
_DOMAIN_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_DOMAIN = rf"{_DOMAIN_COMPONENT}(?:\.{_DOMAIN_COMPONENT})*(?::[0-9]+)?"
_TAG = r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}"
_DIGEST = r"[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,}"
_REFERENCE = re.compile(
    rf"(?:(?P<domain>{_DOMAIN})/)?(?P<path>{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*)"
    rf"(?::(?P<tag>{_TAG}))?(?:@(?P<digest>{_DIGEST}))?")


@dataclass(frozen=True)
class ImageReference:
    repository: str  # with its domain, if it named one
    tag: str
    digest: str

    @property
    def name(self) -> str:
        """What the allowlist is matched against: repository:tag, or @digest."""
        return f"{self.repository}@{self.digest}" if self.digest else f"{self.repository}:{self.tag}"


def parse_reference(reference: str) -> ImageReference:
    if not reference:
        raise InvalidArgument("an image reference is required", field=FIELD)
    if len(reference) > MAX_REFERENCE_CHARS:
        raise InvalidArgument(f"longer than {MAX_REFERENCE_CHARS} characters", field=FIELD)
    match = _REFERENCE.fullmatch(reference)
    if match is None:
        shown = reference.encode("unicode_escape").decode("ascii")[:80]
        raise InvalidArgument(f"{shown!r} is not an image reference (repository[:tag][@digest]: lowercase "
                              "path components of letters and digits, no '..', no empty components)", field=FIELD)
    domain, path = match.group("domain"), match.group("path")
    # Only a registry's name may have capitals (Docker: "repository name must be lowercase").
    if domain and domain != domain.lower() and not ("." in domain or ":" in domain):
        raise InvalidArgument(f"{domain!r}: repository names are lowercase", field=FIELD)
    repository = f"{domain}/{path}" if domain else path
    digest = match.group("digest") or ""
    return ImageReference(repository, match.group("tag") or ("" if digest else "latest"), digest)


def _pattern(pattern: str) -> re.Pattern[str]:
    out = []
    for ch in pattern:
        out.append("[^/]*" if ch == "*" else "[^/]" if ch == "?" else re.escape(ch))
    return re.compile("".join(out))


def allowed(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether `name` (repository:tag or repository@digest) matches a pattern."""
    return any(_pattern(p).fullmatch(name) for p in patterns)


def allowed_resolution(repo_tags: tuple[str, ...], patterns: tuple[str, ...]) -> bool:
    """Whether the image the engine resolved a reference to carries an allowed name."""
    return any(allowed(tag, patterns) for tag in repo_tags)
