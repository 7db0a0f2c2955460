"""The error of file-access recording."""


class FileWatchError(Exception):
    """A call's file accesses cannot be recorded (no reader, no group, no mark)."""
