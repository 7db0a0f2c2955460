"""`sandboxd-mcp`: an MCP server whose tools run as sandboxd calls under a policy its
operator fixed (docs/MCP.md). A module per job:

- cli.py: the command line, stdio or streamable HTTP
- config.py: the operator's options made into a ServerConfig (the policy, the caps)
- narrowing.py: what a tool call may ask of the operator's policy (less, never more)
- arguments.py: each tool's arguments, checked and named when wrong (and their schemas)
- tools.py: the tools: what each runs in the sandbox
- results.py: a finished call made into the model's answer (output capped, head and tail)
- capping.py: the head-and-tail cut of long output
- runner.py: the daemon connection and the warm lease under it
- server.py: the MCP SDK's low-level server wired to the parts above
- http.py: the streamable HTTP listener: loopback, bearer token or mutual TLS

Nothing here imports the MCP SDK at import time except server.py and http.py; the SDK is
the `mcp` extra of the client package."""
