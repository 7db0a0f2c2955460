/*
 * sandbox-shim: what the daemon sets up inside a sandbox just before the command runs.
 *
 *   sandbox-shim [--egress SOCKET PORT] [--env NAME=FILE]... -- ARGV...
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
 * Then it execs ARGV in its own place, so ARGV stays the init's direct child and its
 * exit status is the sandbox's.
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
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#define RELAY_BUF (64 * 1024)
#define MAX_SECRET (64 * 1024)

static void die(const char *what) {
    fprintf(stderr, "sandboxd egress-shim: %s: %s\n", what, strerror(errno));
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

static void usage(void) {
    fprintf(stderr, "usage: sandbox-shim [--egress SOCKET PORT] [--env NAME=FILE]... -- ARGV...\n");
    exit(2);
}

int main(int argc, char **argv) {
    int i = 1;
    const char *egress_sock = NULL, *egress_port = NULL;
    for (; i < argc && strcmp(argv[i], "--") != 0; i++) {
        if (strcmp(argv[i], "--egress") == 0 && i + 2 < argc) {
            egress_sock = argv[++i];
            egress_port = argv[++i];
        } else if (strcmp(argv[i], "--env") == 0 && i + 1 < argc) {
            env_from_file(argv[++i]);
        } else {
            usage();
        }
    }
    if (i + 1 >= argc)
        usage();
    char **cmd = &argv[i + 1];
    if (egress_sock)
        start_egress(egress_sock, egress_port);
    execvp(cmd[0], cmd);
    fprintf(stderr, "sandboxd: cannot run %s: %s\n", cmd[0], strerror(errno));
    return errno == ENOENT ? 127 : 126;
}
