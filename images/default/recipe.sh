# shellcheck shell=bash
# Recipe for sandboxd/default: what coding agents expect of a Debian machine.
# images/minimal's packages plus pip and venv, node and npm, make and a C compiler,
# ripgrep and jq (images/default/packages).
# Sourced by images/build.sh (see the recipe API there).

# shellcheck source=images/lib/debian.sh
source "$HERE/lib/debian.sh"

recipe_build() { debian_build "$1"; }
