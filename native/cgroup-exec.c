/* Joins cgroups, then execs: how the daemon starts nsjail inside a sandbox's cgroup on
 * cgroup v2 (daemon/sandboxd/backends/cgroups.py, V2.popen_in).
 *
 *     sandboxd-cgroup-exec STATUS_FD CGROUP_PROCS... -- PROGRAM [ARG]...
 *
 * v2 moves whole processes only, so the process must put itself into the cgroup before
 * it becomes nsjail. Done by a preexec_fn, that meant Python running in a child forked
 * from the threaded daemon, which once in a while hung there for good (and ruled out
 * vfork). This runs instead: it writes "0" (itself) into each CGROUP_PROCS, then execs
 * PROGRAM, which is born in the cgroup.
 *
 * STATUS_FD is the write end of the caller's pipe, made close-on-exec here: the caller
 * reads it to EOF. Nothing there means PROGRAM started; otherwise it says why not (and
 * this exits 125 without running it). Static, libc only. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int status_fd = 2;

static void fail(const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (n < 0)
        n = 0;
    if ((size_t)n >= sizeof msg)
        n = sizeof msg - 1;
    (void)!write(status_fd, msg, (size_t)n);
    _exit(125);
}

int main(int argc, char **argv) {
    char *end;
    if (argc < 2)
        fail("usage: sandboxd-cgroup-exec STATUS_FD CGROUP_PROCS... -- PROGRAM [ARG]...");
    long fd = strtol(argv[1], &end, 10);
    if (*argv[1] == '\0' || *end != '\0' || fd < 0 || fd > 1 << 20 || fcntl((int)fd, F_SETFD, FD_CLOEXEC) != 0)
        fail("bad status descriptor %s", argv[1]);
    status_fd = (int)fd;
    int i = 2;
    for (; i < argc && strcmp(argv[i], "--") != 0; i++) {
        int procs = open(argv[i], O_WRONLY | O_CLOEXEC);
        if (procs < 0)
            fail("cannot open %s: %s", argv[i], strerror(errno));
        if (write(procs, "0", 1) != 1)
            fail("cannot join %s: %s", argv[i], strerror(errno));
        close(procs);
    }
    if (i + 1 >= argc)
        fail("no program after --");
    execvp(argv[i + 1], argv + i + 1);
    fail("cannot run %s: %s", argv[i + 1], strerror(errno));
    return 125;
}
