"""What the daemon and its clients share: the generated gRPC stubs, canonical JSON and
the hash chain's rules, the approval digest, and the call's JSON form."""

__version__ = "0.1.0"
