"""sandboxd.policy.images: the Docker reference grammar and the image allowlist (pure)."""

from __future__ import annotations

import pytest

from sandboxd.core.errors import InvalidArgument
from sandboxd.policy.images import MAX_REFERENCE_CHARS, allowed, allowed_resolution, parse_reference

PATTERNS = ("sandboxd/*", "library/python:3.*")


@pytest.mark.parametrize("reference, name", [
    ("sandboxd/default", "sandboxd/default:latest"),
    ("sandboxd/default:v1.2-rc_3", "sandboxd/default:v1.2-rc_3"),
    ("registry.example:5000/team/tool:1", "registry.example:5000/team/tool:1"),
    ("Registry.Example/team/tool", "Registry.Example/team/tool:latest"),
    ("a__b/c-d--e/f.g:1", "a__b/c-d--e/f.g:1"),
    ("sandboxd/default@sha256:" + "ab" * 32, "sandboxd/default@sha256:" + "ab" * 32),
])
def test_references_in_the_grammar_are_named(reference, name):
    assert parse_reference(reference).name == name


@pytest.mark.parametrize("reference", [
    "sandboxd/../other:latest",  # the red-team's: dockerd cleans the path to another image
    "sandboxd/./default", "sandboxd//default", "/sandboxd/default", "sandboxd/default/",
    "sandboxd/.default", "sandboxd/default.", "sandboxd/-x", "Sandboxd/default", "sandboxd/Default",
    "sandboxd/default:", "sandboxd/default:-x", "sandboxd/default:" + "t" * 129,
    "sandboxd/default\x00", "sandboxd/default\n", "sandboxd/défault", "sandboxd/default:tâg",
    "sandboxd/default@sha256:short", "sandboxd/default@", "", " sandboxd/default", "a" * (MAX_REFERENCE_CHARS + 1),
])
def test_references_outside_the_grammar_are_invalid_arguments(reference):
    with pytest.raises(InvalidArgument) as exc:
        parse_reference(reference)
    assert exc.value.field == "runtime.image"
    assert "\x00" not in exc.value.message and "\n" not in exc.value.message


@pytest.mark.parametrize("name, ok", [
    ("sandboxd/default:latest", True),
    ("sandboxd/default@sha256:" + "ab" * 32, True),
    ("sandboxd/nested/other:latest", False),  # `*` never crosses a `/`
    ("sandboxd:latest", False),
    ("library/python:3.12", True),
    ("library/python:2.7", False),
    ("library/python/evil:3.1", False),
    ("other/sandboxd/default:latest", False),
])
def test_allowlist_stars_stay_within_one_path_component(name, ok):
    assert allowed(name, PATTERNS) is ok


def test_the_resolved_image_needs_an_allowed_name_of_its_own():
    assert allowed_resolution(("probe/other:latest", "sandboxd/busybox:latest"), PATTERNS)
    assert not allowed_resolution(("probe/other:latest",), PATTERNS)
    assert not allowed_resolution((), PATTERNS), "an untagged image (named by its id) is never allowed"
