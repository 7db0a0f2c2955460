"""The sandbox engines: Docker and nsjail, and what both use on the host (staging of
workspace roots, cgroups, the backstop watcher, daemon locks)."""
