"""The hand-written text of docs/CONFIGURATION.md that settings.py cannot carry:
the page's opening and the meanings of settings whose comment is missing or covers a
group. Read by gen-config-docs.py (beside it)."""

# Settings whose comment in settings.py sits above a group of fields (and so names only
# the first), or that have none. Move a meaning into settings.py as a comment above its
# field and delete it here: the generator refuses an entry for a field that has one.
UNCOMMENTED: dict[str, str] = {
    "socket_path": "The Unix socket the daemon serves gRPC on; callers are identified by their uid on it.",
    "socket_group": "Group of the socket file (a name or a number); unset: the daemon's own.",
    "state_dir": "Private directory (0700) of the event log (sandboxd.db), the forensic index (audit.db), "
                 "artifact blobs, output spools and checkpoints. Never mountable into a sandbox.",
    "root_workspace_gid": "gid the sandbox runs as when the workspace's group is root (unset: such a "
                          "workspace is refused, unless it is root-owned: then root_workspace_uid's number).",
    "default_backend": "The engine of a call whose runtime.adapter is empty: `docker` or `nsjail`.",
    "default_image": "The image of a call whose runtime.image is empty.",
    "docker_host": "dockerd's address (as DOCKER_HOST); unset: unix:///var/run/docker.sock.",
    "seccomp_profile": "The seccomp profile (Docker's JSON format) both backends enforce; nsjail gets it "
                       "compiled to BPF.",
    "cgroup_exec_binary": "On cgroup v2, the static helper that starts nsjail inside a sandbox's cgroup "
                          "(native/cgroup-exec.c, `make native`).",
    "runtime_dir": "Per-sandbox host parts: staged roots (mounts/), output FIFOs (stdio/) and, by default, "
                   "the secrets tmpfs (secrets/).",
    "max_concurrent_calls": "Calls running at once, daemon-wide, across every principal.",
    "grace_period_s": "At stop, running calls are cancelled: how long the daemon waits for their sandboxes "
                      "to be removed and their results recorded.",
    "log_level": "Python logging level of the daemon's JSON log on stderr (DEBUG, INFO, WARNING, ERROR).",
    "daemon_id": "This daemon's id, on every container and cgroup it makes (a restart reaps its own); "
                 "unset: a random `sd-...` made at the first start and kept in <state_dir>/daemon_id.",
    "limits.default_timeout_ms": "Wall-clock limit of a call whose policy sets no timeoutMs.",
    "limits.max_timeout_ms": "The largest timeoutMs a policy may ask for.",
    "limits.default_memory_mb": "Memory limit (memory + swap) of a call whose policy sets no maxMemoryMb.",
    "limits.max_memory_mb": "The largest maxMemoryMb a policy may ask for.",
    "limits.default_stdout_bytes": "stdout bytes stored when the policy sets no maxStdoutBytes; past it "
                                   "output is counted, dropped and the result says truncated.",
    "limits.default_stderr_bytes": "The same for stderr (maxStderrBytes).",
    "limits.max_output_bytes": "The largest maxStdoutBytes or maxStderrBytes a policy may ask for.",
    "limits.default_pids": "Processes and threads at once when the policy sets no maxPids.",
    "limits.max_pids": "The largest maxPids a policy may ask for.",
    "limits.default_cpu_millicores": "CPU quota (1000 = one CPU) when the policy sets no cpuMillicores.",
    "limits.max_cpu_millicores": "The largest cpuMillicores a policy may ask for.",
    "limits.default_file_size_mb": "Largest file a process may write (RLIMIT_FSIZE) when the policy sets "
                                   "no maxFileSizeMb.",
    "limits.max_file_size_mb": "The largest maxFileSizeMb a policy may ask for.",
    "limits.default_tmp_size_mb": "Size of the tempDir tmpfs when the policy sets no maxTmpSizeMb (shrunk "
                                  "to three quarters of the memory limit if that is less: a tmpfs is memory).",
    "limits.max_tmp_size_mb": "The largest maxTmpSizeMb a policy may ask for.",
    "limits.max_argv_bytes": "All of a call's arguments together.",
    "limits.max_stdin_bytes": "A call's stdin.",
    "limits.preview_bytes": "Bytes of stdout and of stderr kept inline in the ToolResult's previews.",
    "nsjail.enabled": "Whether the nsjail backend is started; off: calls naming it are refused.",
    "nsjail.rootfs_dir": "Where each image's root filesystem is exported (once per image id) for the jails.",
    "nsjail.init_binary": "The static init (tini) run as each jail's PID 1; Debian's `tini` package.",
    "nsjail.warm_slots": "nsjail processes kept started and waiting for a call's config (~5 ms off a call).",
    "egress.enabled": "Whether the egress proxy runs; off: calls that need it (egress `allowlist`, and "
                      "`open` with denyPrivateNetworks) are refused.",
    "egress.system_dns": "With no dns_servers: whether a name missing from `hosts` is resolved by the "
                         "host's resolver; off: it is refused (502).",
    "egress.connect_timeout_s": "How long the proxy waits for a destination to accept a connection.",
    "egress.max_connections_per_sandbox": "Connections one sandbox may have open through the proxy at once.",
    "file_audit.hash_budget_mb": "The uncached bytes one walk may read to hash (see hash_max_file_mb).",
    "pools.min_idle": "Idle warm sandboxes each pool keeps ready (refilled in the background, up to "
                      "max_size); none for a pool whose sandboxes may write the workspace (an idle one "
                      "would hold it alone).",
    "pools.max_size": "Sandboxes of one pool at most, counting those leased, being made and being removed.",
    "pools.idle_ttl_s": "An idle warm sandbox, and a pool unused, for this long is removed.",
    "pools.default_lease_s": "A lease's length when the acquire names none.",
    "pools.max_lease_s": "The longest a lease lasts; an acquire asking for more gets this.",
    "quotas.concurrent_calls": "Calls one principal may run at once (unless per_principal names it).",
    "rpc_limits.unary_calls_per_principal": "Concurrent unary RPCs per principal (everything but Execute, "
                                            "Run and streaming responses).",
    "rpc_limits.stream_idle_timeout_s": "A client stream that sends nothing for this long is ended.",
    "rpc_limits.unauthenticated_connections": "Connections at once of all uids that are no principal, "
                                              "together.",
    "rpc_limits.max_connections": "Connections at once on the public socket, overall.",
    "tcp.key_file": "The daemon's private key (PEM) for cert_file.",
}


INTRO = """\
# Configuration

<!-- Generated by scripts/gen-config-docs.py from daemon/sandboxd/core/settings.py.
     Do not edit by hand: change the comments in settings.py and run
     `.venv/bin/python scripts/gen-config-docs.py` (a unit test fails while this file is stale). -->

`sandboxd` starts with embedded defaults: no file is needed. A YAML file given with
`--config FILE` (or the `SANDBOXD_CONFIG` environment variable) overrides any setting,
and `--socket`, `--state-dir`, `--workspace-root` (repeatable) and `--log-level`
override the file. A file needs only what it changes:

```yaml sandboxd-config
principals: {0: root, 1000: alice}
workspace_roots: [/srv/sandboxd/workspaces]
limits: {default_timeout_ms: 120000}
```

The file is read strictly: an unknown key, a wrong type or a value out of bounds stops
the daemon at start (exit 2) with the setting's path and the reason; nothing is ignored.
Modes are written in octal (`0o660`, `0660` or `"0o660"`); a decimal `660` is refused.
Durations are in the unit their name ends with (`_ms`, `_s`, `_days`), sizes likewise
(`_bytes`, `_mb`). An editor can check a file against
[sandboxd-config.schema.json](sandboxd-config.schema.json) (JSON Schema 2020-12).

What a *call* may do is its SandboxPolicy, not this file; the file sets the defaults a
policy falls back on and the maxima it may ask for ([limits](#limits)).
"""
