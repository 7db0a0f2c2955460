"""sandboxd: the execution boundary for AI agents' tool calls."""

# The one place the version is written: the wheels read it (packaging) and
# `sandboxd --version` prints it. The client and the contract carry the same.
__version__ = "0.1.0"
