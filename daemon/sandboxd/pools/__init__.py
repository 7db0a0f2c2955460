"""Warm sandboxes kept per (workspace, image, backend, policy class) and leased to calls."""
