"""What every layer stands on: errors, settings, host directories, safe path opening, metrics primitives."""
