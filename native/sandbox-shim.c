/*
 * sandbox-shim: what the daemon sets up inside a sandbox just before the command runs.
 *
 *   sandbox-shim [--seccomp FILE] [--stdio DIR] [--gate FIFO] [--egress SOCKET PORT] [--env NAME=FILE]... -- ARGV...
 *   sandbox-shim [--egress SOCKET PORT] [--env NAME=FILE]... --supervise CONTROL
 *
 * --env NAME=FILE  reads FILE (a secret bound in from the daemon's tmpfs) into the
 *                  environment variable NAME: the value never appears in the engine's
 *                  container config, on a command line, or in the daemon's own env.
 * --egress SOCKET PORT
 *                  makes the daemon's egress proxy reachable from a sandbox that has no
 *                  network at all (only its own loopback): binds 127.0.0.1:PORT (and
 *                  [::1]:PORT when the sandbox has IPv6 loopback) and starts a forwarder
 *                  that relays every accepted connection to the Unix socket SOCKET (the
 *                  daemon's per-sandbox proxy, bind-mounted in).
 *
 * --stdio DIR     makes DIR/stdout and DIR/stderr (FIFOs the daemon reads, bound in)
 *                  the command's stdout and stderr: its output goes straight to the
 *                  daemon instead of through the engine's copy of the container's
 *                  stdio (containerd-shim, dockerd, the attach socket). Opened first:
 *                  the daemon holds their read ends before the sandbox starts, so the
 *                  opens never block.
 *
 * --seccomp FILE   loads FILE (a classic BPF program: the daemon's seccomp profile,
 *                  compiled by libseccomp) as this process's seccomp filter, with
 *                  no_new_privs, before anything else; whatever it execs inherits it.
 *                  The nsjail backend runs the shim this way as the jail's first
 *                  process, ahead of the jail's init.
 *
 * --gate FIFO      waits until the daemon writes a byte into FIFO before the command
 *                  runs (the daemon first attaches its file-access watch to the
 *                  sandbox's mounts, which exist only once the sandbox does).
 *
 * Then it execs ARGV in its own place, so ARGV stays the init's direct child and its
 * exit status is the sandbox's.
 *
 * --supervise CONTROL keeps a warm sandbox instead: it connects to the daemon's
 * SOCK_SEQPACKET socket CONTROL (bound in read-only; the daemon accepts that one
 * connection and no other, so nothing a command does can stand in for the supervisor),
 * says "R", and runs one command per request on that connection. A request is one
 * message: the command's stdin, stdout and stderr as SCM_RIGHTS descriptors, and
 * "cwd\0argc\0argv...\0envc\0env...\0" (and, with credential files, one more
 * descriptor per file holding its content and "filec\0tempdir\0path...\0": each is
 * written under tempDir, mode 0400, for that command only). The supervisor answers "P <pid>" once the
 * command runs and "X <wait status>" when it is over; "K" from the daemon kills it.
 * Before "X" every other process of the sandbox but init, the supervisor (and the
 * egress forwarder) is killed: a command's background children never outlive it. The
 * supervisor is not dumpable, so a command (same uid) cannot take its descriptors.
 *
 * The listeners exist before ARGV starts: a command that connects at once never races
 * the forwarder. The forwarder is double-forked, so it is the init's child, not ARGV's:
 * a shell that `wait`s for its children never waits for it. It runs as the sandbox
 * user, with its stdio on /dev/null: killing it only cuts the sandbox off from the
 * proxy, and it never holds the sandbox's output pipes open.
 *
 * Static, libc only: the same binary serves every image and both backends.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#define RELAY_BUF (64 * 1024)
#define MAX_SECRET (64 * 1024)

static void die(const char *what) {
    fprintf(stderr, "sandboxd shim: %s: %s\n", what, strerror(errno));
    exit(126);
}

static int listen_on(int family, int port) {
    int fd = socket(family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    int rc;
    if (family == AF_INET) {
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port)};
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        rc = bind(fd, (struct sockaddr *)&a, sizeof a);
    } else {
        setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &one, sizeof one);
        struct sockaddr_in6 a = {.sin6_family = AF_INET6, .sin6_port = htons(port)};
        a.sin6_addr = in6addr_loopback;
        rc = bind(fd, (struct sockaddr *)&a, sizeof a);
    }
    if (rc < 0 || listen(fd, 128) < 0) {
        int saved = errno;
        close(fd);
        errno = saved;
        return -1;
    }
    return fd;
}

static int connect_proxy(const char *path) {
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    strncpy(a.sun_path, path, sizeof a.sun_path - 1);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Copies both ways until both directions reached EOF, passing half-closes on. */
static void relay(int a, int b) {
    static char buf[RELAY_BUF];
    int open_ab = 1, open_ba = 1;
    while (open_ab || open_ba) {
        struct pollfd p[2] = {{.fd = open_ab ? a : -1, .events = POLLIN},
                              {.fd = open_ba ? b : -1, .events = POLLIN}};
        if (poll(p, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            return;
        }
        for (int i = 0; i < 2; i++) {
            if (!(p[i].revents & (POLLIN | POLLHUP | POLLERR)))
                continue;
            int from = i == 0 ? a : b, to = i == 0 ? b : a;
            ssize_t n = read(from, buf, sizeof buf);
            if (n <= 0) {
                if (n < 0 && (errno == EINTR || errno == EAGAIN))
                    continue;
                if (n < 0)
                    return; /* reset: drop both */
                shutdown(to, SHUT_WR);
                if (i == 0)
                    open_ab = 0;
                else
                    open_ba = 0;
                continue;
            }
            for (ssize_t off = 0; off < n;) {
                ssize_t w = write(to, buf + off, (size_t)(n - off));
                if (w < 0) {
                    if (errno == EINTR)
                        continue;
                    return;
                }
                off += w;
            }
        }
    }
}

static void serve(int l4, int l6, const char *sock_path) {
    signal(SIGCHLD, SIG_IGN); /* connection children reap themselves */
    signal(SIGPIPE, SIG_IGN);
    struct pollfd p[2] = {{.fd = l4, .events = POLLIN}, {.fd = l6, .events = POLLIN}};
    for (;;) {
        if (poll(p, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            _exit(1);
        }
        for (int i = 0; i < 2; i++) {
            if (p[i].fd < 0 || !(p[i].revents & POLLIN))
                continue;
            int c = accept4(p[i].fd, NULL, NULL, SOCK_CLOEXEC);
            if (c < 0)
                continue;
            pid_t pid = fork();
            if (pid == 0) {
                close(l4);
                if (l6 >= 0)
                    close(l6);
                int one = 1;
                setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                int u = connect_proxy(sock_path);
                if (u >= 0)
                    relay(c, u);
                _exit(0);
            }
            close(c);
        }
    }
}

/* Sets NAME to FILE's contents (at most MAX_SECRET bytes, no NUL). */
static void env_from_file(const char *spec) {
    const char *eq = strchr(spec, '=');
    if (!eq || eq == spec) {
        fprintf(stderr, "sandboxd sandbox-shim: bad --env %s\n", spec);
        exit(2);
    }
    char name[256];
    size_t nlen = (size_t)(eq - spec);
    if (nlen >= sizeof name) {
        fprintf(stderr, "sandboxd sandbox-shim: variable name too long\n");
        exit(2);
    }
    memcpy(name, spec, nlen);
    name[nlen] = 0;
    int fd = open(eq + 1, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        die("open a secret");
    static char value[MAX_SECRET + 1];
    size_t len = 0;
    for (;;) {
        ssize_t n = read(fd, value + len, MAX_SECRET - len);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0)
            die("read a secret");
        if (n == 0)
            break;
        len += (size_t)n;
        if (len == MAX_SECRET)
            break;
    }
    close(fd);
    value[len] = 0;
    if (strlen(value) != len) {
        fprintf(stderr, "sandboxd sandbox-shim: secret for %s contains a NUL byte\n", name);
        exit(2);
    }
    if (setenv(name, value, 1) < 0)
        die("setenv");
    memset(value, 0, len);
}

static void start_egress(const char *sock_path, const char *port_text) {
    int port = atoi(port_text);
    if (port <= 0 || port > 65535) {
        fprintf(stderr, "sandboxd sandbox-shim: bad port %s\n", port_text);
        exit(2);
    }
    int l4 = listen_on(AF_INET, port);
    if (l4 < 0)
        die("listen on 127.0.0.1");
    int l6 = listen_on(AF_INET6, port); /* optional: the sandbox may have no IPv6 */

    pid_t first = fork();
    if (first < 0)
        die("fork");
    if (first == 0) {
        pid_t second = fork();
        if (second == 0) {
            setsid();
            int null = open("/dev/null", O_RDWR);
            if (null >= 0) {
                dup2(null, 0);
                dup2(null, 1);
                dup2(null, 2);
                if (null > 2)
                    close(null);
            }
            serve(l4, l6, sock_path);
        }
        _exit(second < 0 ? 1 : 0);
    }
    int status;
    while (waitpid(first, &status, 0) < 0 && errno == EINTR)
        ;
    close(l4);
    if (l6 >= 0)
        close(l6);
}

#define MAX_REQUEST (1024 * 1024)
#define MAX_ITEMS 65536
#define MAX_FILES 16

/* The running command, and its wait status once reaped (by whichever waitpid got it). */
static pid_t cmd_pid = 0;
static int cmd_status = 0;
static int cmd_reaped = 0;

static void reap(int flags) {
    int st;
    pid_t got;
    while ((got = waitpid(-1, &st, flags)) > 0) {
        if (got == cmd_pid) {
            cmd_status = st;
            cmd_reaped = 1;
        }
        if (flags == 0)
            break;
    }
}

/* SIGKILL to every process of this PID namespace but init, the supervisor and the
 * given one; then reap what is ours. Returns how many were killed. */
static int kill_others(pid_t except) {
    int killed = 0;
    for (int round = 0; round < 50; round++) {
        DIR *d = opendir("/proc");
        if (!d)
            return killed;
        int found = 0;
        struct dirent *e;
        while ((e = readdir(d)) != NULL) {
            char *end;
            long pid = strtol(e->d_name, &end, 10);
            if (*end || pid <= 1 || pid == getpid() || pid == except)
                continue;
            if (kill((pid_t)pid, SIGKILL) == 0) {
                found++;
                killed++;
            }
        }
        closedir(d);
        reap(WNOHANG);
        if (!found)
            break;
        usleep(1000);
    }
    return killed;
}

/* The egress forwarder, if any: it serves every command of the sandbox. */
static pid_t forwarder_pid = 0;

static pid_t find_forwarder(void) {
    DIR *d = opendir("/proc");
    pid_t found = 0;
    if (!d)
        return 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        char *end;
        long pid = strtol(e->d_name, &end, 10);
        if (!*end && pid > 1 && pid != getpid())
            found = (pid_t)pid;
    }
    closedir(d);
    return found;
}

static void reply(int conn, const char *text) {
    send(conn, text, strlen(text), MSG_NOSIGNAL);
}

/* A credential file for one command: written under the sandbox's tempDir (its own
 * tmpfs) through descriptors opened without following symlinks, so nothing a
 * previous command left there can send the secret elsewhere; removed after it. */
struct placed {
    int dir;
    char rel[4096]; /* the path below tempDir; `name` points into it */
    const char *name;
};

static int bad_component(const char *name) {
    return !*name || strcmp(name, ".") == 0 || strcmp(name, "..") == 0;
}

/* Copies `content` into a new file; NULL or why not. */
static const char *copy_into(int fd, int content) {
    char chunk[4096];
    off_t off = 0;
    ssize_t r;
    while ((r = pread(content, chunk, sizeof chunk, off)) != 0) {
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return "the credential could not be read";
        }
        for (ssize_t done = 0; done < r;) {
            ssize_t w = write(fd, chunk + done, r - done);
            if (w < 0)
                return "the file cannot be written";
            done += w;
        }
        off += r;
    }
    return NULL;
}

static const char *place_secret(const char *tmpdir, const char *path, int content, struct placed *out) {
    size_t n = strlen(tmpdir);
    if (strncmp(path, tmpdir, n) != 0 || path[n] != '/' || !path[n + 1])
        return "the path is not inside tempDir";
    char *rel = out->rel;
    if (strlen(path + n + 1) >= sizeof out->rel)
        return "the path is too long";
    strcpy(rel, path + n + 1);
    int dir = open(tmpdir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dir < 0)
        return "tempDir cannot be opened";
    const char *why = NULL;
    char *name = rel;
    for (char *slash; (slash = strchr(name, '/')) != NULL; name = slash + 1) {
        *slash = 0;
        if (bad_component(name)) {
            why = "the path is not normalized";
            goto fail;
        }
        if (mkdirat(dir, name, 0700) < 0 && errno != EEXIST) {
            why = "a directory on the way cannot be made";
            goto fail;
        }
        int next = openat(dir, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
        if (next < 0) {
            why = "a directory on the way is not one (or is a symlink)";
            goto fail;
        }
        close(dir);
        dir = next;
    }
    if (bad_component(name)) {
        why = "the path is not normalized";
        goto fail;
    }
    if (unlinkat(dir, name, 0) < 0 && errno != ENOENT) {
        why = "something that is not a file is in the way";
        goto fail;
    }
    int fd = openat(dir, name, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0400);
    if (fd < 0) {
        why = "the file cannot be created";
        goto fail;
    }
    why = copy_into(fd, content);
    close(fd);
    if (why) {
        unlinkat(dir, name, 0);
        goto fail;
    }
    out->dir = dir;
    out->name = name;
    return NULL;
fail:
    close(dir);
    return why;
}

static void remove_placed(struct placed *placed, int count) {
    for (int k = 0; k < count; k++) {
        unlinkat(placed[k].dir, placed[k].name, 0);
        close(placed[k].dir);
    }
}

/* One command: spawn, report, wait (or kill on request), clean up, report. Returns
 * 0 when the daemon is gone (its connection closed). */
static int run_one(int conn) {
    int alive = 1;
    static char buf[MAX_REQUEST + 1];
    char control[CMSG_SPACE((3 + MAX_FILES) * sizeof(int))];
    struct iovec iov = {.iov_base = buf, .iov_len = MAX_REQUEST};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control, .msg_controllen = sizeof control};
    ssize_t n = recvmsg(conn, &msg, MSG_CMSG_CLOEXEC);
    if (n == 0 || (n < 0 && errno != EINTR))
        return 0;
    if (n < 0)
        return 1;
    if (n == 1 && buf[0] == 'K' && msg.msg_controllen == 0)
        return 1; /* a kill that crossed the last command's end: nothing runs, no answer */
    buf[n] = 0;
    int fds[3 + MAX_FILES];
    int nfds = 0, nplaced = 0;
    struct placed placed[MAX_FILES];
    struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
    if (c && c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS && c->cmsg_len >= CMSG_LEN(0)) {
        int got = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        int *passed = (int *)CMSG_DATA(c);
        for (int k = 0; k < got; k++) {
            if (k < 3 + MAX_FILES)
                fds[nfds++] = passed[k];
            else
                close(passed[k]); /* more than any request has: refused below */
        }
        if (got > 3 + MAX_FILES)
            nfds = -nfds; /* marks the request as refused; the kept ones close at out */
    }
    if (nfds < 0) {
        nfds = -nfds;
        reply(conn, "E too many descriptors");
        goto out;
    }
    if (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) {
        reply(conn, "E bad request");
        goto out;
    }
    if (nfds < 3) {
        reply(conn, "E need three descriptors (and one per credential file)");
        goto out;
    }
    /* Fields: cwd, argc, argv..., envc, env... (each NUL-terminated). */
    char *items[2 * MAX_ITEMS + 4];
    int count = 0;
    for (char *p = buf; p < buf + n && count < (int)(sizeof items / sizeof items[0]); p += strlen(p) + 1)
        items[count++] = p;
    int i = 0;
    const char *cwd = count > i ? items[i++] : NULL;
    int argc = count > i ? atoi(items[i++]) : 0;
    if (!cwd || argc <= 0 || argc > MAX_ITEMS || i + argc >= count) {
        reply(conn, "E malformed request");
        goto out;
    }
    char **argv = &items[i];
    i += argc;
    int envc = atoi(items[i]);
    char *saved = items[i];
    i++;
    if (envc < 0 || envc > MAX_ITEMS || i + envc > count) {
        reply(conn, "E malformed request");
        goto out;
    }
    char **envp = &items[i];
    (void)saved;
    i += envc;
    /* Then, when credential files come along: filec\0tempdir\0path...\0 */
    int filec = i < count ? atoi(items[i++]) : 0;
    if (filec != nfds - 3 || (filec > 0 && i + 1 + filec > count)) {
        reply(conn, "E malformed request");
        goto out;
    }
    for (int k = 0; k < filec; k++) {
        const char *why = place_secret(items[i], items[i + 1 + k], fds[3 + k], &placed[nplaced]);
        if (why) {
            char line[256];
            snprintf(line, sizeof line, "E credential file %s: %s", items[i + 1 + k], why);
            reply(conn, line);
            goto out;
        }
        nplaced++;
    }
    char *argv_z[MAX_ITEMS + 1], *envp_z[MAX_ITEMS + 1];
    memcpy(argv_z, argv, argc * sizeof(char *));
    argv_z[argc] = NULL;
    memcpy(envp_z, envp, envc * sizeof(char *));
    envp_z[envc] = NULL;

    sigset_t chld;
    sigemptyset(&chld);
    sigaddset(&chld, SIGCHLD);
    sigprocmask(SIG_BLOCK, &chld, NULL);
    int sfd = signalfd(-1, &chld, SFD_CLOEXEC);
    pid_t pid = fork();
    if (pid == 0) {
        sigprocmask(SIG_UNBLOCK, &chld, NULL);
        setsid();
        dup2(fds[0], 0);
        dup2(fds[1], 1);
        dup2(fds[2], 2);
        if (chdir(cwd) < 0) {
            fprintf(stderr, "sandboxd: cannot enter %s: %s\n", cwd, strerror(errno));
            _exit(126);
        }
        execvpe(argv_z[0], argv_z, envp_z);
        fprintf(stderr, "sandboxd: cannot run %s: %s\n", argv_z[0], strerror(errno));
        _exit(errno == ENOENT ? 127 : 126);
    }
    for (int k = 0; k < nfds; k++)
        close(fds[k]);
    nfds = 0;
    if (pid < 0) {
        reply(conn, "E fork failed");
        close(sfd);
        sigprocmask(SIG_UNBLOCK, &chld, NULL);
        remove_placed(placed, nplaced);
        return 1;
    }
    char line[64];
    snprintf(line, sizeof line, "P %d", (int)pid);
    reply(conn, line);
    cmd_pid = pid;
    cmd_reaped = 0;
    for (;;) {
        reap(WNOHANG);
        if (cmd_reaped)
            break;
        struct pollfd p[2] = {{.fd = sfd, .events = POLLIN}, {.fd = conn, .events = POLLIN}};
        if (poll(p, 2, -1) < 0 && errno != EINTR)
            break;
        if (p[0].revents & POLLIN) {
            struct signalfd_siginfo si;
            if (read(sfd, &si, sizeof si) < 0) { /* drained below by waitpid */
            }
        }
        if (p[1].revents & (POLLIN | POLLHUP | POLLERR)) {
            char k;
            ssize_t r = recv(conn, &k, 1, MSG_DONTWAIT);
            if (r <= 0 || k == 'K') {
                kill(-pid, SIGKILL);
                kill(pid, SIGKILL);
                kill_others(forwarder_pid);
                if (r <= 0) { /* the daemon went away: nobody to tell */
                    while (!cmd_reaped && errno != ECHILD)
                        reap(0);
                    alive = 0;
                    break;
                }
            }
        }
    }
    kill_others(forwarder_pid);
    close(sfd);
    sigprocmask(SIG_UNBLOCK, &chld, NULL);
    cmd_pid = 0;
    remove_placed(placed, nplaced); /* before "X": the next command never finds them */
    nplaced = 0;
    if (alive) {
        snprintf(line, sizeof line, "X %d", cmd_status);
        reply(conn, line);
    }
out:
    for (int k = 0; k < nfds; k++)
        close(fds[k]);
    remove_placed(placed, nplaced);
    return alive;
}

static void supervise(const char *path) {
    /* Not dumpable: a command of the same uid cannot open /proc/<us>/fd or pidfd_getfd. */
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    int conn = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (conn < 0)
        die("socket");
    struct sockaddr_un a = {.sun_family = AF_UNIX};
    strncpy(a.sun_path, path, sizeof a.sun_path - 1);
    if (connect(conn, (struct sockaddr *)&a, sizeof a) < 0)
        die("connect to the daemon's control socket");
    signal(SIGPIPE, SIG_IGN);
    reply(conn, "R");
    while (run_one(conn))
        ;
    /* The daemon is gone: so is this sandbox. */
    kill_others(0);
    exit(0);
}

static void wait_at_gate(const char *path) {
    /* Opened without waiting for the daemon's end of the FIFO: the open itself tells
     * the daemon (inotify IN_OPEN) that the sandbox is up, with no polling. poll() then
     * waits for its byte (or for its end closing without one: POLLHUP). */
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
        die("open the gate");
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    while (poll(&pfd, 1, -1) < 0 && errno == EINTR)
        ;
    char b;
    ssize_t n;
    while ((n = read(fd, &b, 1)) < 0 && errno == EINTR)
        ;
    close(fd);
    if (n != 1) {
        fprintf(stderr, "sandboxd: the daemon did not open the gate\n");
        exit(125);
    }
}

static void load_seccomp(const char *path) {
    static struct sock_filter program[BPF_MAXINSNS + 1];
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        die("open the seccomp program");
    size_t n = 0;
    ssize_t got;
    for (;;) {
        got = read(fd, (char *)program + n, sizeof program - n);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            break;
        n += (size_t)got;
    }
    if (got < 0)
        die("read the seccomp program");
    close(fd);
    if (n == 0 || n % sizeof(struct sock_filter) || n > BPF_MAXINSNS * sizeof(struct sock_filter)) {
        errno = EINVAL;
        die("the seccomp program");
    }
    struct sock_fprog fprog = {.len = (unsigned short)(n / sizeof(struct sock_filter)), .filter = program};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
        die("set no_new_privs");
    if (syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &fprog) < 0)
        die("load the seccomp program");
}

static void stdio_to(const char *dir) {
    static const char *names[] = {"stdout", "stderr"};
    char path[4096];
    for (int target = 1; target <= 2; target++) {
        if (snprintf(path, sizeof path, "%s/%s", dir, names[target - 1]) >= (int)sizeof path) {
            errno = ENAMETOOLONG;
            die("the stdio directory");
        }
        int fd = open(path, O_WRONLY | O_CLOEXEC);
        if (fd < 0)
            die("open the daemon's output pipe");
        if (fd == target) {  /* fd 1 or 2 was closed: the open took its place */
            if (fcntl(fd, F_SETFD, 0) < 0)
                die("keep the daemon's output pipe open across exec");
            continue;
        }
        if (dup2(fd, target) < 0)  /* dup2 clears close-on-exec on the copy */
            die("dup2 the daemon's output pipe");
        close(fd);
    }
}

static void usage(void) {
    fprintf(stderr, "usage: sandbox-shim [--seccomp FILE] [--stdio DIR] [--gate FIFO] [--egress SOCKET PORT] [--env NAME=FILE]... (-- ARGV... | --supervise CONTROL)\n");
    exit(2);
}

int main(int argc, char **argv) {
    int i = 1;
    const char *egress_sock = NULL, *egress_port = NULL, *control = NULL, *gate = NULL, *stdio = NULL;
    for (; i < argc && strcmp(argv[i], "--") != 0; i++) {
        if (strcmp(argv[i], "--supervise") == 0 && i + 1 < argc) {
            control = argv[++i];
        } else if (strcmp(argv[i], "--seccomp") == 0 && i + 1 < argc) {
            load_seccomp(argv[++i]);  /* at once: everything after runs under it */
        } else if (strcmp(argv[i], "--stdio") == 0 && i + 1 < argc) {
            stdio = argv[++i];
        } else if (strcmp(argv[i], "--gate") == 0 && i + 1 < argc) {
            gate = argv[++i];
        } else if (strcmp(argv[i], "--egress") == 0 && i + 2 < argc) {
            egress_sock = argv[++i];
            egress_port = argv[++i];
        } else if (strcmp(argv[i], "--env") == 0 && i + 1 < argc) {
            env_from_file(argv[++i]);
        } else {
            usage();
        }
    }
    if (control) {
        if (egress_sock) {
            start_egress(egress_sock, egress_port);
            forwarder_pid = find_forwarder();
        }
        supervise(control);
    }
    if (i + 1 >= argc)
        usage();
    char **cmd = &argv[i + 1];
    if (stdio)
        stdio_to(stdio);
    if (egress_sock)
        start_egress(egress_sock, egress_port);
    if (gate)
        wait_at_gate(gate);
    execvp(cmd[0], cmd);
    fprintf(stderr, "sandboxd: cannot run %s: %s\n", cmd[0], strerror(errno));
    return errno == ENOENT ? 127 : 126;
}
