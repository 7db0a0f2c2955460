"""File-access recording: fanotify per call, and before/after snapshots of the writable mounts."""
