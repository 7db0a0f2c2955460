"""What the cgroup v2 guest says when it stops short: the tests it finished, and those it
never reached (tests/integration/guests.progress)."""

from __future__ import annotations

from tests.integration.guests import progress


def test_a_guest_out_of_time_names_what_it_finished_and_what_it_did_not():
    expected = ["tests/integration/a.py::one[nsjail]", "tests/integration/a.py::two[nsjail]",
                "tests/integration/b.py::three"]
    log = ("booting...\n"
           "tests/integration/a.py::one[nsjail] PASSED                  [ 33%]\n"
           "tests/integration/a.py::two[nsjail] FAILED                  [ 66%]\n"
           "cgroup2-vm: TIMEOUT: the guest ran longer than 1200s\n")
    said = progress(log, expected)
    assert "finished 2 of 3" in said and "PASSED tests/integration/a.py::one[nsjail]" in said
    assert "FAILED tests/integration/a.py::two[nsjail]" in said
    assert said.endswith("never reached 1:\n  tests/integration/b.py::three")
