"""sandboxd.check.report (pure): how findings are settled against the default backend,
rendered as lines and as JSON, and which exit status they give."""

from __future__ import annotations

import json

from sandboxd.check.report import (DAEMON, EXIT_CONFIG, EXIT_FAIL, EXIT_OK, Finding, exit_status, render_json,
                                   render_text, settle)

BOTH = ["docker", "nsjail"]


def by_probe(findings: list[Finding]) -> dict[str, Finding]:
    return {f.probe: f for f in findings}


class TestSettle:
    def test_all_ok_gives_a_line_per_backend_and_exit_0(self):
        got = settle([Finding("root", "ok", "uid 0", needed_by=(DAEMON,))], "docker", BOTH)
        lines = by_probe(got)
        assert lines["backend docker"].status == "ok" and "(the default) can run" in lines["backend docker"].reason
        assert lines["backend nsjail"].status == "ok"
        assert exit_status(got) == EXIT_OK

    def test_a_failure_of_the_default_backend_stays_a_failure(self):
        got = settle([Finding("dockerd", "fail", "does not answer", needed_by=("docker",))], "docker", BOTH)
        lines = by_probe(got)
        assert lines["dockerd"].status == "fail"
        assert lines["backend docker"].status == "fail" and "see dockerd" in lines["backend docker"].reason
        assert lines["backend nsjail"].status == "ok"
        assert exit_status(got) == EXIT_FAIL

    def test_a_failure_only_another_backend_needs_is_a_warning(self):
        got = settle([Finding("nsjail-sha256", "fail", "has sha256 x, not y", needed_by=("nsjail",))], "docker", BOTH)
        lines = by_probe(got)
        assert lines["nsjail-sha256"].status == "warn"
        assert "nsjail backend will be unavailable" in lines["nsjail-sha256"].reason
        assert "has sha256 x, not y" in lines["nsjail-sha256"].reason
        assert lines["backend nsjail"].status == "warn" and "see nsjail-sha256" in lines["backend nsjail"].reason
        assert lines["backend docker"].status == "ok"
        assert exit_status(got) == EXIT_OK

    def test_the_same_failure_fails_when_nsjail_is_the_default(self):
        got = settle([Finding("nsjail-sha256", "fail", "mismatch", needed_by=("nsjail",))], "nsjail", BOTH)
        assert by_probe(got)["nsjail-sha256"].status == "fail"
        assert by_probe(got)["backend nsjail"].status == "fail"
        assert exit_status(got) == EXIT_FAIL

    def test_a_failure_both_backends_need_fails(self):
        got = settle([Finding("images", "fail", "absent", needed_by=("docker", "nsjail"))], "docker", BOTH)
        lines = by_probe(got)
        assert lines["images"].status == "fail"
        assert lines["backend docker"].status == "fail" and lines["backend nsjail"].status == "warn"

    def test_a_failure_the_daemon_needs_fails_whatever_the_default(self):
        got = settle([Finding("state_dir", "fail", "owned by uid 1001", needed_by=(DAEMON,))], "docker", BOTH)
        lines = by_probe(got)
        assert lines["state_dir"].status == "fail"
        assert lines["backend docker"].status == "fail" and lines["backend nsjail"].status == "warn"
        assert exit_status(got) == EXIT_FAIL

    def test_warnings_pass(self):
        got = settle([Finding("fanotify", "warn", "off")], "docker", ["docker"])
        assert exit_status(got) == EXIT_OK and [f.probe for f in got] == ["fanotify", "backend docker"]

    def test_a_disabled_backend_gets_no_line(self):
        got = settle([Finding("root", "ok", "uid 0")], "docker", ["docker"])
        assert "backend nsjail" not in by_probe(got)


class TestExitStatus:
    def test_a_config_failure_is_2(self):
        assert exit_status([Finding("config", "fail", "bad", field="socket_mode"),
                            Finding("dockerd", "fail", "down")]) == EXIT_CONFIG == 2

    def test_another_failure_is_1(self):
        assert exit_status([Finding("config", "ok", "loads"), Finding("root", "fail", "uid 1000")]) == EXIT_FAIL == 1

    def test_ok_and_warnings_are_0(self):
        assert exit_status([Finding("a", "ok", ""), Finding("b", "warn", "")]) == EXIT_OK == 0


class TestRendering:
    def test_text_lines_have_status_probe_field_and_reason(self):
        text = render_text([Finding("config", "fail", "660 is written in decimal", field="socket_mode"),
                            Finding("root", "ok", "running as root")], "sandboxd check (x.yaml)")
        lines = text.splitlines()
        assert lines[0] == "sandboxd check (x.yaml)"
        assert lines[1] == "fail  config  socket_mode: 660 is written in decimal"
        assert lines[2] == "ok    root    running as root"

    def test_json_is_a_list_of_findings(self):
        got = json.loads(render_json([Finding("config", "fail", "unknown key", field="bogus"),
                                      Finding("dockerd", "ok", "answers", needed_by=("docker",))]))
        assert got == [
            {"probe": "config", "status": "fail", "reason": "unknown key", "needed_by": [], "field": "bogus"},
            {"probe": "dockerd", "status": "ok", "reason": "answers", "needed_by": ["docker"]},
        ]
