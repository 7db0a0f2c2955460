"""Snapshots of write roots kept current by inotify between and during calls, so that a
call's before/after snapshots cost O(what changed) instead of a walk of the whole tree:
`LiveSnapshots` keeps a `RootTracker` (root_tracker.py) per write root, walks a root it
cannot track (snapshot.take), and, when asked to, refreshes its trackers ahead of the
next call on a thread of its own (started by the store, never at import).

Each root's snapshot, walked or tracked, asks the baseline whether a call with secrets
may have written there (baseline.withheld): then what it hashes is refused, not kept,
and once one begun after the call hashed every file small enough to keep, the root is
settled. A root withheld while a snapshot of it ran has what that snapshot kept refused."""

from __future__ import annotations

import logging
import os
import select
import stat
import threading
import time
from collections import OrderedDict

from collections.abc import Iterable

from sandboxd.recording.baseline import Baseline
from sandboxd.recording.root_tracker import RootTracker, Untrackable
from sandboxd.recording.snapshot import Entry, HashBudget, HashCache, Snapshot, take

__all__ = ["AHEAD_HASH_BYTES", "AHEAD_IDLE_S", "AHEAD_MAX_DELAY_S", "IDLE_S", "MAX_TRACKERS", "UNTRACKED_S",
           "LiveSnapshots", "RootTracker", "Untrackable"]

log = logging.getLogger("sandboxd.recording.live_snapshot")

# Trackers kept (each holds an inotify instance), and how long an unused one lives.
MAX_TRACKERS = 32
IDLE_S = 900.0
# A root whose tracker gave up (watch limit, entry cap, a tree that never settles) is
# walked for this long before it is tracked again.
UNTRACKED_S = 300.0
# Refreshing ahead of calls: what one refresh may hash (a bigger change is hashed by the
# call's own snapshot), the longest wait between refreshes of a root that keeps changing
# with no call (the wait doubles from refresh_after_s), and how long after its last call
# a root is still refreshed at all.
AHEAD_HASH_BYTES = 16 * 1024 * 1024
AHEAD_MAX_DELAY_S = 2.0
AHEAD_IDLE_S = 120.0

class LiveSnapshots:
    """`take` with the result of snapshot.take, from trackers kept per write root."""

    def __init__(self, hashes: HashCache | None, max_trackers: int = MAX_TRACKERS, idle_s: float = IDLE_S,
                 refresh_after_s: float | None = None):
        """`refresh_after_s`: a thread brings a tracker up to date that long after a
        change reaches it (what changed between calls, by the host or by a call that
        records nothing, is then not rescanned by the next call's snapshot)."""
        self._hashes = hashes
        self._max = max_trackers
        self._idle_s = idle_s
        self._lock = threading.Lock()
        self._trackers: OrderedDict[tuple[str, str], RootTracker] = OrderedDict()
        self._untracked: dict[tuple[str, str], float] = {}  # root -> when to try tracking again
        self.fallbacks = 0  # walks done because a root could not be tracked
        self.refreshes = 0  # trackers brought up to date ahead of a call (for tests)
        self._closed = False
        self._refresh_after_s = refresh_after_s
        self._soon: set[tuple[str, str]] = set()  # roots to refresh now (refresh_soon)
        self._refresher: threading.Thread | None = None
        if refresh_after_s is not None:
            self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
            self._refresher = threading.Thread(target=self._refresh_loop, name="write-roots", daemon=True)
            self._refresher.start()

    def take(self, binds: list[tuple[str, str]], budget: HashBudget | None = None,
             max_entries: int = 200_000) -> Snapshot:
        budget = budget or HashBudget()
        out = Snapshot()
        shared = False  # out.entries is a tracker's copy (to be copied before it is added to)
        baseline = self._baseline()
        for sandbox_root, host_root in binds:
            left = max_entries - len(out.entries)
            since = baseline.tick() if baseline is not None else 0
            keep = budget.keep and (baseline is None or not baseline.withheld(host_root))
            part = None
            if left > 0:
                # The tracker spends a copy: one that gives up leaves the walk its budget.
                spent = HashBudget(budget.bytes_left, budget.max_file, keep, [])
                part = self._tracked(sandbox_root, host_root, spent, left)
                self._refuse_if_withheld(baseline, host_root, spent)
                if part is not None:
                    budget.bytes_left = spent.bytes_left
                    if not keep:
                        self._settle_if_whole(baseline, host_root, since, part.gaps,
                                              part.entries.values() if part.unhashed else ())
            if part is None:
                self.fallbacks += 1
                out.walked = True
                if shared:  # the walk adds to it
                    out.entries, shared = dict(out.entries), False
                gaps = len(out.gaps)
                walk = HashBudget(budget.bytes_left, budget.max_file, keep, [])
                take([(sandbox_root, host_root)], self._hashes, walk, max_entries, into=out)
                budget.bytes_left = walk.bytes_left
                self._refuse_if_withheld(baseline, host_root, walk)
                if not keep:
                    below = sandbox_root.rstrip("/") + "/"
                    self._settle_if_whole(baseline, host_root, since, out.gaps[gaps:],
                                          (e for p, e in out.entries.items()
                                           if e.note and (p == sandbox_root or p.startswith(below))))
                if len(out.gaps) > gaps and len(out.entries) >= max_entries:
                    break  # the cap: the walk stops there too
                continue
            if not out.entries and not out.gaps:
                out.entries = part.entries  # the tracker's own copy: never changed below
                shared = True
            else:
                if shared:
                    out.entries, shared = dict(out.entries), False
                out.entries.update(part.entries)
            out.gaps += part.gaps
            out.unhashed += part.unhashed
            out.origins.update(part.origins)
        return out

    def _baseline(self) -> Baseline | None:
        baseline = self._hashes.baseline if self._hashes is not None else None
        return baseline if isinstance(baseline, Baseline) else None

    @staticmethod
    def _refuse_if_withheld(baseline: Baseline | None, host_root: str, spent: HashBudget) -> None:
        """What a snapshot kept is refused if a call with secrets took the root meanwhile."""
        if baseline is not None and spent.keep and spent.kept and baseline.withheld(host_root):
            for digest in spent.kept:
                baseline.refuse(digest)

    @staticmethod
    def _settle_if_whole(baseline: Baseline | None, host_root: str, since: int, gaps: list[str],
                         unhashed: Iterable[Entry]) -> None:
        """A withheld root's snapshot begun at `since` that hashed it whole (every file
        small enough to keep, its hash refused) settles it."""
        if baseline is not None and not gaps \
                and not any(e.note and stat.S_ISREG(e.mode) and baseline.wants(e.size) for e in unhashed):
            baseline.settle(host_root, since)

    def _tracked(self, sandbox_root: str, host_root: str, budget: HashBudget, max_entries: int) -> Snapshot | None:
        key = (sandbox_root, host_root)
        try:
            if not stat.S_ISDIR(os.lstat(host_root).st_mode):
                return None  # a bind of one file (or a root gone): the walk says what it is
        except OSError:
            return None
        tracker = self._tracker(key)
        if tracker is None:
            return None
        with tracker.lock:
            try:
                if tracker.closed:
                    return None  # retired meanwhile
                return tracker.snapshot(budget, max_entries)
            except (Untrackable, OSError) as exc:
                self._give_up(key, tracker, exc)
                return None

    def _give_up(self, key: tuple[str, str], tracker: RootTracker, exc: Exception) -> None:
        """Holds tracker.lock. Its watches go (they count against the host's limits), and
        the root is walked for a while rather than tracked and walked on every call."""
        log.info("write root %s is walked in full for %.0f s: %s", key[1], UNTRACKED_S, exc)
        tracker.close()
        with self._lock:
            if self._trackers.get(key) is tracker:
                del self._trackers[key]
            self._untracked[key] = time.monotonic() + UNTRACKED_S

    def _refresh_loop(self) -> None:
        """Polls the trackers' inotify descriptors; a tracker with news is refreshed
        `refresh_after_s` later (a burst of changes is taken in one go)."""
        assert self._refresh_after_s is not None
        due: dict[tuple[str, str], float] = {}
        while not self._closed:
            with self._lock:
                trackers = dict(self._trackers)
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            watched = {}
            for key, tracker in trackers.items():
                fd = tracker.fileno()
                if fd >= 0 and key not in due:
                    poller.register(fd, select.POLLIN)
                    watched[fd] = key
            now = time.monotonic()
            # At least once a second the descriptors are looked at again: a tracker that
            # walked its root in full has a new one.
            timeout = 1000 if not due else max(0, min(1000, int((min(due.values()) - now) * 1000) + 1))
            for fd, events in poller.poll(timeout):
                if fd == self._wake_r:
                    try:
                        os.read(self._wake_r, 4096)
                    except BlockingIOError:
                        pass
                elif fd in watched and events & select.POLLIN:
                    tracker = trackers[watched[fd]]
                    delay = min(AHEAD_MAX_DELAY_S, self._refresh_after_s * 2 ** min(tracker.ahead, 16))
                    due.setdefault(watched[fd], time.monotonic() + delay)
            now = time.monotonic()
            with self._lock:
                soon, self._soon = self._soon, set()
            for key in soon & trackers.keys():
                due[key] = now
            for key in [k for k, t in due.items() if t <= now]:
                del due[key]
                due_tracker = trackers.get(key)
                if due_tracker is not None:
                    self._refresh_ahead(key, due_tracker)
            for key in [k for k in due if k not in trackers]:
                del due[key]

    def _refresh_ahead(self, key: tuple[str, str], tracker: RootTracker) -> None:
        with tracker.lock:
            if tracker.closed or tracker.fileno() < 0 or time.monotonic() - tracker.last_used > AHEAD_IDLE_S:
                return  # idle: its queue waits for the next call (or overflows: a walk then)
            budget_bytes, max_file, max_entries = tracker.caps
            baseline = self._baseline()
            since = baseline.tick() if baseline is not None else 0
            keep = baseline is None or not baseline.withheld(key[1])
            try:
                ahead = HashBudget(min(budget_bytes, AHEAD_HASH_BYTES), min(max_file, AHEAD_HASH_BYTES), keep, [])
                snap = tracker.snapshot(ahead, max_entries, use=False)
                self._refuse_if_withheld(baseline, key[1], ahead)
                if not keep:
                    self._settle_if_whole(baseline, key[1], since, snap.gaps,
                                          snap.entries.values() if snap.unhashed else ())
                tracker.ahead += 1
                self.refreshes += 1
            except (Untrackable, OSError) as exc:
                self._give_up(key, tracker, exc)
            except Exception as exc:
                log.exception("refreshing the write root %s failed", key[1])
                self._give_up(key, tracker, exc)

    def _tracker(self, key: tuple[str, str]) -> RootTracker | None:
        now = time.monotonic()
        retired = []
        with self._lock:
            if self._untracked.get(key, 0) > now:
                return None
            self._untracked.pop(key, None)
            for k in [k for k, t in self._trackers.items() if now - t.last_used > self._idle_s and k != key]:
                retired.append(self._trackers.pop(k))
            tracker = self._trackers.get(key)
            if tracker is None:
                while len(self._trackers) >= self._max:
                    retired.append(self._trackers.pop(next(iter(self._trackers))))
                tracker = self._trackers[key] = RootTracker(key[0], key[1], self._hashes)
                self._wake_refresher()
            self._trackers.move_to_end(key)
        for t in retired:  # outside the registry's lock: a snapshot in progress finishes first
            with t.lock:
                t.close()
        return tracker

    @staticmethod
    def changed_between(before: Snapshot, after: Snapshot) -> set[str] | None:
        """Every path whose entry may differ between two snapshots of the same write
        roots, from their trackers' records; None when a root was walked or its tracker
        cannot tell (then the snapshots are compared entry by entry)."""
        if before.walked or after.walked or before.origins.keys() != after.origins.keys():
            return None
        out: set[str] = set()
        for root, (tracker, earlier) in before.origins.items():
            now, later = after.origins[root]
            if now is not tracker:
                return None
            with tracker.lock:
                paths = tracker.changed_between(earlier, later)
            if paths is None:
                return None
            out |= paths
        return out

    def refresh_soon(self, binds: list[tuple[str, str]]) -> None:
        """These roots were just changed by a call that took no snapshot of them: their
        trackers are brought up to date now, off the caller's thread."""
        with self._lock:
            if self._refresher is None or self._closed:
                return
            self._soon.update(k for k in binds if k in self._trackers)
            self._wake_refresher()

    def _wake_refresher(self) -> None:
        """Holds self._lock (close() shuts the pipe under it)."""
        if self._refresher is not None and not self._closed:
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:
                pass  # it has wakes pending

    def close(self) -> None:
        with self._lock:
            refresher = self._refresher
            self._wake_refresher()
            self._closed = True
        if refresher is not None:
            refresher.join(5)
            with self._lock:
                if not refresher.is_alive() and self._refresher is not None:
                    os.close(self._wake_r)
                    os.close(self._wake_w)
                    self._refresher = None
        with self._lock:
            trackers, self._trackers = list(self._trackers.values()), OrderedDict()
        for t in trackers:
            with t.lock:
                t.close()
