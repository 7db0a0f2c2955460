"""Prometheus text-format metrics on a small HTTP endpoint (GET /metrics). Off unless
`metrics_address` is set. It names pools by key and backend only: no workspace paths,
principals or commands leave through it."""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger("sandboxd.core.metrics")

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Histogram:
    """Cumulative-bucket histogram, as Prometheus reads it."""

    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS):
        self._buckets = buckets
        self._counts = [0] * (len(buckets) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self._buckets, value)] += 1
            self._sum += value

    def render(self, name: str, labels: str = "") -> list[str]:
        with self._lock:
            counts, total_sum = list(self._counts), self._sum
        out, running = [], 0
        sep = "," if labels else ""
        for bound, n in zip(self._buckets, counts):
            running += n
            out.append(f'{name}_bucket{{{labels}{sep}le="{bound}"}} {running}')
        running += counts[-1]
        out.append(f'{name}_bucket{{{labels}{sep}le="+Inf"}} {running}')
        braces = f"{{{labels}}}" if labels else ""
        out.append(f"{name}_sum{braces} {total_sum}")
        out.append(f"{name}_count{braces} {running}")
        return out


def render(families: list[tuple[str, str, str, list[str]]]) -> str:
    """(name, type, help, sample lines) -> the exposition text."""
    lines: list[str] = []
    for name, kind, help_text, samples in families:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(samples)
    return "\n".join(lines) + "\n"


class MetricsServer:
    def __init__(self, address: str, collect: Callable[[], str]):
        host, _, port = address.rpartition(":")
        collect_fn = collect

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's naming
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404)
                    return
                body = collect_fn().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self._server = ThreadingHTTPServer((host.strip("[]") or "127.0.0.1", int(port)), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics", daemon=True)

    def start(self) -> None:
        self._thread.start()
        log.info("metrics on port %d", self.port)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
