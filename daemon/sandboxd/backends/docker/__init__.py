"""The Docker engine: its compiler, backend and output reader."""
