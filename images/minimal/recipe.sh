# shellcheck shell=bash
# Recipe for sandboxd/minimal: Debian bookworm minbase + python3, git, curl (no pip,
# no venv, no compiler, no node): the smallest Debian image a tool call runs in.
# Sourced by images/build.sh (see the recipe API there).

# shellcheck source=images/lib/debian.sh
source "$HERE/lib/debian.sh"

recipe_build() { debian_build "$1"; }
