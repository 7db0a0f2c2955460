"""The housekeeping after a call's result, on a thread of its own: the recorded call's
spool removed (six file operations, a third of a millisecond) and the log's head
checkpointed (at most once a second, a fsync of 1-4 ms that fell to whichever call ended
then). A spool left behind goes with the spool directory at the next start."""

from __future__ import annotations

import logging
import queue
import threading

from sandboxd.ledger.events import CheckpointFile
from sandboxd.sandbox.output import OutputSpool

log = logging.getLogger("sandboxd.calls.janitor")


class Janitor:
    def __init__(self, checkpoints: CheckpointFile | None):
        self._checkpoints = checkpoints
        self._queue: queue.SimpleQueue[tuple[OutputSpool | None, str] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._tidy, name="call-janitor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def after_call(self, spool: OutputSpool | None, tool_call_id: str) -> None:
        """Off the caller's path: the spool removed (None: kept, for a recovery) and
        the log checkpointed."""
        self._queue.put((spool, tool_call_id))

    def checkpoint_soon(self) -> None:
        """The log's head checkpointed off the caller's path (a refusal, a lease's events)."""
        self._queue.put((None, ""))

    def checkpoint(self, force: bool = False) -> None:
        if self._checkpoints is not None:
            try:
                self._checkpoints.checkpoint(force)
            except OSError:
                log.exception("writing the log checkpoint failed")

    def stop(self, timeout_s: float) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _tidy(self) -> None:
        behind = False
        while True:
            try:
                # A checkpoint skipped (another was written under an interval ago) is
                # written once the interval has passed, not only after a later call.
                item = self._queue.get(timeout=self._checkpoints.min_interval_s
                                       if behind and self._checkpoints is not None else None)
            except queue.Empty:
                item = (None, "")
            if item is None:
                return
            spool, tool_call_id = item
            if spool is not None:
                try:
                    spool.discard()
                except Exception:  # never lose the janitor: the next start removes it
                    log.exception("removing the spool of %s failed", tool_call_id)
            try:
                self.checkpoint()
                behind = self._checkpoints is not None and self._checkpoints.skipped
            except Exception:  # never lose the janitor: it tries again
                log.exception("checkpointing after %s failed", tool_call_id or "a skipped checkpoint")
                behind = self._checkpoints is not None
