"""Credentials: the broker that resolves and places them, and the redaction of their values."""
