"""The cgroup layouts as pure path and file logic, on fake hierarchies in a temporary
directory (the real ones: tests/integration/test_nsjail_backend.py on this host's v1,
tests/integration/test_cgroup_v2.py in a guest whose only hierarchy is v2)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from sandboxd.backends import cgroups
from sandboxd.backends.cgroups import V1, V2, CgroupUnavailable, cgroup_usage, detect


def touch(path: Path, text: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def v2_tree(root: Path, controllers: str = "cpuset cpu io memory hugetlb pids rdma misc") -> Path:
    touch(root / "cgroup.controllers", controllers + "\n")
    touch(root / "cgroup.subtree_control", "")
    return root


def test_a_host_with_a_v1_memory_hierarchy_is_v1_even_beside_a_unified_one(tmp_path):
    touch(tmp_path / "memory" / "cgroup.procs")
    touch(tmp_path / "unified" / "cgroup.controllers")
    assert isinstance(detect(str(tmp_path)), V1)


def test_a_host_whose_root_is_the_unified_hierarchy_is_v2(tmp_path):
    assert isinstance(detect(str(v2_tree(tmp_path))), V2)


def test_a_host_without_cgroups_has_no_layout(tmp_path):
    assert detect(str(tmp_path)) is None


def test_v1_keeps_one_directory_per_controller_and_v2_one(tmp_path):
    assert V1(str(tmp_path)).dirs("a/b") == [f"{tmp_path}/{c}/a/b" for c in ("memory", "pids", "cpu", "cpuacct")]
    assert V1(str(tmp_path)).pids_dir("a/b") == f"{tmp_path}/pids/a/b"
    assert V2(str(tmp_path)).dirs("a/b") == [f"{tmp_path}/a/b"]
    assert V2(str(tmp_path)).pids_dir("a/b") == f"{tmp_path}/a/b"


def test_v2_limits_are_spelled_as_the_unified_hierarchy_wants(tmp_path):
    layout = V2(str(tmp_path))
    layout.swap_control = True
    assert layout.limits(256 << 20, 65, 50_000, 100_000) == {
        "memory.max": str(256 << 20), "memory.swap.max": "0", "pids.max": "65", "cpu.max": "50000 100000"}
    assert layout.limit_path("sandboxd-nsjail/d/s", "cpu.max") == f"{tmp_path}/sandboxd-nsjail/d/s/cpu.max"


def test_v2_without_a_cpu_quota_says_max_and_without_swap_accounting_writes_no_swap_limit(tmp_path):
    layout = V2(str(tmp_path))
    layout.swap_control = False
    limits = layout.limits(1 << 20, 8, 0, 100_000)
    assert limits["cpu.max"] == "max 100000"
    assert "memory.swap.max" not in limits


def test_v1_limits_keep_the_controller_in_the_key(tmp_path):
    touch(tmp_path / "memory" / "memory.memsw.limit_in_bytes")
    layout = V1(str(tmp_path))
    limits = layout.limits(1 << 20, 8, 20_000, 100_000)
    assert limits == {"memory/memory.limit_in_bytes": str(1 << 20), "memory/memory.memsw.limit_in_bytes": str(1 << 20),
                      "pids/pids.max": "8", "cpu/cpu.cfs_period_us": "100000", "cpu/cpu.cfs_quota_us": "20000"}
    assert layout.limit_path("x/y", "pids/pids.max") == f"{tmp_path}/pids/x/y/pids.max"


def test_v2_make_enables_the_controllers_at_every_level_above_the_sandbox_once(tmp_path, monkeypatch):
    v2_tree(tmp_path)
    for rel in ("sandboxd-nsjail", "sandboxd-nsjail/d"):
        touch(tmp_path / rel / "cgroup.subtree_control", "")
    writes = []
    real_write = cgroups._write
    monkeypatch.setattr(cgroups, "_write", lambda path, value: (writes.append((path, value)), real_write(path, value)))
    layout = V2(str(tmp_path))
    layout.make("sandboxd-nsjail/d/sbx-1")
    assert (tmp_path / "sandboxd-nsjail" / "d" / "sbx-1").is_dir()
    assert writes == [(f"{p}/cgroup.subtree_control", "+memory +pids +cpu")
                      for p in (tmp_path, tmp_path / "sandboxd-nsjail", tmp_path / "sandboxd-nsjail" / "d")]
    writes.clear()
    layout.make("sandboxd-nsjail/d/sbx-2")
    assert writes == []  # known delegated


def test_v2_make_only_enables_what_is_missing(tmp_path, monkeypatch):
    v2_tree(tmp_path)
    (tmp_path / "cgroup.subtree_control").write_text("cpu memory pids io\n")
    touch(tmp_path / "top" / "cgroup.subtree_control", "memory\n")
    writes = []
    monkeypatch.setattr(cgroups, "_write", lambda path, value: writes.append((path, value)))
    V2(str(tmp_path)).make("top/sbx")
    assert writes == [(f"{tmp_path}/top/cgroup.subtree_control", "+pids +cpu")]


def test_v2_check_refuses_a_hierarchy_whose_controllers_are_bound_to_v1(tmp_path):
    v2_tree(tmp_path, controllers="hugetlb perf_event")
    with pytest.raises(CgroupUnavailable, match="does not offer memory, pids, cpu"):
        V2(str(tmp_path)).check("sandboxd-nsjail")


def test_v2_check_refuses_a_top_cgroup_without_the_limit_files(tmp_path):
    v2_tree(tmp_path)
    touch(tmp_path / "sandboxd-nsjail" / "cgroup.subtree_control")
    touch(tmp_path / "sandboxd-nsjail" / "memory.max")
    with pytest.raises(CgroupUnavailable, match="lacks memory.events, pids.max, cpu.max, cpu.stat"):
        V2(str(tmp_path)).check("sandboxd-nsjail")


def test_v1_check_names_the_controller_that_lacks_a_file(tmp_path):
    for c, files in cgroups._V1_FILES.items():
        for f in files:
            touch(tmp_path / c / "sandboxd-nsjail" / f)
    os.remove(tmp_path / "pids" / "sandboxd-nsjail" / "pids.max")
    with pytest.raises(CgroupUnavailable, match="'pids' controller .* lacks pids.max"):
        V1(str(tmp_path)).check("sandboxd-nsjail")


def test_oom_kills_are_read_from_each_versions_own_file(tmp_path):
    touch(tmp_path / "memory" / "s" / "memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    assert V1(str(tmp_path)).oom_kills("s") == 3
    touch(tmp_path / "s" / "memory.events", "low 0\nhigh 0\nmax 9\noom 2\noom_kill 1\noom_group_kill 0\n")
    assert V2(str(tmp_path)).oom_kills("s") == 1
    assert V2(str(tmp_path)).oom_kills("gone") == 0


def test_a_sandboxs_oom_kills_are_read_for_its_cgroup_on_either_version(tmp_path):
    """What DockerBackend.collect adds to dockerd's OOMKilled flag, which it may miss."""
    v2 = tmp_path / "v2"
    touch(v2 / "sandboxd" / "sbx-1" / "memory.events", "oom 1\noom_kill 2\noom_group_kill 1\n")
    assert cgroups.oom_kills_in("/sandboxd/sbx-1/", str(v2)) == 2
    assert cgroups.oom_kills_in("sandboxd/gone", str(v2)) == 0
    v1 = tmp_path / "v1"
    touch(v1 / "memory" / "sandboxd" / "sbx-1" / "memory.oom_control", "oom_kill_disable 0\noom_kill 1\n")
    assert cgroups.oom_kills_in("sandboxd/sbx-1", str(v1)) == 1


def test_usage_on_v2_is_the_peak_and_cpu_stat(tmp_path):
    touch(tmp_path / "s" / "memory.peak", "7340032\n")
    touch(tmp_path / "s" / "cpu.stat", "usage_usec 25300\nuser_usec 20000\nsystem_usec 5300\n")
    assert cgroup_usage("/s/", str(tmp_path)) == cgroups.ResourceUsage(cpu_ms=25, peak_memory_bytes=7340032)


def test_usage_on_v1_is_max_usage_and_cpuacct(tmp_path):
    touch(tmp_path / "memory" / "s" / "memory.max_usage_in_bytes", "4096\n")
    touch(tmp_path / "cpuacct" / "s" / "cpuacct.usage", "3000000000\n")
    assert cgroup_usage("s", str(tmp_path)) == cgroups.ResourceUsage(cpu_ms=3000, peak_memory_bytes=4096)


def test_a_failed_v1_rename_puts_back_the_controllers_already_renamed(tmp_path):
    layout = V1(str(tmp_path))
    for d in layout.dirs("p/slot"):
        os.makedirs(d)
    touch(tmp_path / "cpu" / "p" / "sbx" / "occupied")  # a non-empty target: that rename fails
    with pytest.raises(OSError):
        layout.rename("p/slot", "p/sbx")
    assert all(os.path.isdir(d) for d in layout.dirs("p/slot"))
    assert not os.path.exists(f"{tmp_path}/memory/p/sbx") and not os.path.exists(f"{tmp_path}/pids/p/sbx")


def test_children_are_gathered_from_every_controller(tmp_path):
    layout = V1(str(tmp_path))
    os.makedirs(f"{tmp_path}/memory/p/a")
    os.makedirs(f"{tmp_path}/pids/p/b")
    touch(tmp_path / "cpu" / "p" / "notes")
    assert layout.children("p") == {"a", "b"}


def test_v2_kill_asks_the_kernel_to_kill_the_whole_cgroup(tmp_path):
    kill_file = touch(tmp_path / "s" / "cgroup.kill")
    touch(tmp_path / "s" / "cgroup.procs", "")
    assert V2(str(tmp_path)).kill("s", timeout_s=0.1)
    assert kill_file.read_text() == "1"


def test_v2_never_moves_a_thread(tmp_path):
    with pytest.raises(CgroupUnavailable):
        V2(str(tmp_path)).enter_thread("s")
    assert not V2(str(tmp_path)).moves_threads and V1(str(tmp_path)).moves_threads


def test_a_process_is_started_by_the_helper_that_writes_itself_into_every_directory(tmp_path):
    layout = V1(str(tmp_path))
    files = [touch(Path(d) / "cgroup.procs") for d in layout.dirs("s")]
    out = tmp_path / "ran"
    proc = layout.popen_in("s")(["/bin/sh", "-c", f"echo $$ > {out}"], stdout=subprocess.DEVNULL)
    assert proc.wait(10) == 0
    assert [f.read_text() for f in files] == ["0"] * 4
    assert out.read_text().strip() == str(proc.pid), "the helper execs the command: one process"


def test_a_failed_join_runs_nothing_and_says_why(tmp_path):
    layout = V2(str(tmp_path))  # no such cgroup.procs
    out = tmp_path / "ran"
    with pytest.raises(OSError, match=r"cannot start in cgroup s: cannot open .*/s/cgroup.procs: No such file"):
        layout.popen_in("s")(["/bin/sh", "-c", f"touch {out}"])
    assert not out.exists()


def test_a_command_the_helper_cannot_run_is_an_error_too(tmp_path):
    layout = V2(str(tmp_path))
    touch(Path(layout.dirs("s")[0]) / "cgroup.procs")
    with pytest.raises(OSError, match="cannot run /no/such/program"):
        layout.popen_in("s")(["/no/such/program"])


def test_the_helpers_status_pipe_is_not_left_to_the_command(tmp_path):
    layout = V2(str(tmp_path))
    touch(Path(layout.dirs("s")[0]) / "cgroup.procs")
    proc = layout.popen_in("s")(["/bin/sh", "-c", "ls /proc/self/fd"], stdout=subprocess.PIPE, close_fds=True)
    fds = sorted(int(n) for n in proc.communicate(timeout=10)[0].split())
    assert fds == [0, 1, 2, 3], fds  # stdio and ls's own directory: nothing of the helper's


def test_a_cgroup_made_ahead_carries_the_sandbox_it_now_holds(tmp_path):
    layout = V2(str(tmp_path))
    os.makedirs(layout.dirs("p/.slot-1")[0])
    assert layout.marked("p/.slot-1") is None
    layout.mark("p/.slot-1", "sbx-42")
    assert layout.marked("p/.slot-1") == "sbx-42"
    assert layout.marked("p/gone") is None
    assert V1.renames and not V2.renames


def test_v2_make_enables_the_controllers_again_once_a_level_was_removed(tmp_path, monkeypatch):
    v2_tree(tmp_path)
    writes = []
    monkeypatch.setattr(cgroups, "_write", lambda path, value: writes.append(path))
    layout = V2(str(tmp_path))
    for rel in ("top", "top/d"):
        touch(tmp_path / rel / "cgroup.subtree_control", "")
    layout.make("top/d/s1")
    os.rmdir(tmp_path / "top" / "d" / "s1")
    (tmp_path / "top" / "d" / "cgroup.subtree_control").unlink()
    os.rmdir(tmp_path / "top" / "d")  # a reap removed the daemon's level
    writes.clear()
    real_makedirs = os.makedirs

    def makedirs(path, *a, **kw):  # the kernel gives every new cgroup its files
        real_makedirs(path, *a, **kw)
        Path(path, "cgroup.subtree_control").touch()

    monkeypatch.setattr(cgroups.os, "makedirs", makedirs)
    layout.make("top/d/s2")
    assert f"{tmp_path}/top/d/cgroup.subtree_control" in writes


def test_only_v2_evicts_for_a_lower_memory_limit():
    v2 = V2("/x")
    assert v2.evicts({"memory.max": "100"}, {"memory.max": "200"})
    assert v2.evicts({"memory.max": "100"}, {})  # nothing written ahead: unlimited before
    assert v2.evicts({"memory.max": "100"}, {"memory.max": "max"})
    assert not v2.evicts({"memory.max": "300"}, {"memory.max": "200"})
    assert not v2.evicts({"memory.max": "200"}, {"memory.max": "200"})
    assert not v2.evicts({"memory.max": "max"}, {"memory.max": "200"})
    key = "memory/memory.limit_in_bytes"
    assert not V1("/x").evicts({key: "100"}, {key: "200"})  # v1 refuses the write instead (EBUSY)


def test_v1_controllers_mounted_together_are_one_directory(tmp_path):
    (tmp_path / "cpu,cpuacct").mkdir()
    for c in ("memory", "pids"):
        (tmp_path / c).mkdir()
    os.symlink("cpu,cpuacct", tmp_path / "cpu")
    os.symlink("cpu,cpuacct", tmp_path / "cpuacct")
    layout = V1(str(tmp_path))
    assert layout.dirs("p/s") == [f"{tmp_path}/{c}/p/s" for c in ("memory", "pids", "cpu")]
    for d in layout.dirs("p/slot"):
        os.makedirs(d)
    layout.rename("p/slot", "p/s")  # once per directory: no ENOENT on the second name
    assert os.path.isdir(f"{tmp_path}/cpuacct/p/s")
