/* The peer-credential relay's byte pump (daemon/sandboxd/transport.py), in C.
 *
 * The daemon accepts each client on its public socket itself (to read SO_PEERCRED) and
 * relays the connection to its private gRPC socket. Done by two Python threads, every
 * message woke a thread that had to take the GIL before it could splice again: half a
 * millisecond of a leased command's five, more when the interpreter was busy. Here each
 * direction is a thread outside the interpreter, splicing through a pipe, so the bytes
 * never enter user space either.
 *
 * relay_start(a, b, idle_ms, c1, c2) takes ownership of both descriptors: they are closed
 * when both directions have ended, and then each counter given (connections of the
 * peer's kind, of all kinds) goes down by one: the daemon caps connections with them.
 * With idle_ms > 0, a connection whose client (a) sends nothing for idle_ms is ended both
 * ways: a peer that is no principal cannot hold two threads by keeping quiet.
 * Built as a shared library by `make native` (libc only). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#define CHUNK (1 << 20)

struct link {
    int fd[2];
    int directions_left;
    int *counters[2];
    pthread_mutex_t lock;
};

struct direction {
    struct link *link;
    int src, dst;
    int idle_ms; /* > 0: the most src may stay silent */
};

/* Atomic: the accept loop adds while relay threads take away. */
int relay_count_add(int *counter, int delta) {
    return __atomic_add_fetch(counter, delta, __ATOMIC_SEQ_CST);
}

static void link_free(struct link *l) {
    close(l->fd[0]);
    close(l->fd[1]);
    for (int i = 0; i < 2; i++)
        if (l->counters[i])
            relay_count_add(l->counters[i], -1);
    pthread_mutex_destroy(&l->lock);
    free(l);
}

/* 1 when src has something (or its end) to read, 0 when it stayed silent for idle_ms. */
static int wait_readable(int src, int idle_ms) {
    struct pollfd p = {.fd = src, .events = POLLIN};
    for (;;) {
        int n = poll(&p, 1, idle_ms);
        if (n < 0 && errno == EINTR)
            continue;
        return n != 0;
    }
}

static void pump(int src, int dst, int idle_ms) {
    int p[2];
    if (pipe2(p, O_CLOEXEC) != 0)
        return;
    (void)fcntl(p[1], F_SETPIPE_SZ, CHUNK); /* fewer splices for bulk output; best effort */
    for (;;) {
        if (idle_ms > 0 && !wait_readable(src, idle_ms)) {
            /* Silent too long: end both ways (the other direction's splice returns 0). */
            shutdown(src, SHUT_RDWR);
            shutdown(dst, SHUT_RDWR);
            break;
        }
        ssize_t n = splice(src, NULL, p[1], NULL, CHUNK, SPLICE_F_MOVE);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        while (n > 0) {
            ssize_t m = splice(p[0], NULL, dst, NULL, (size_t)n, SPLICE_F_MOVE);
            if (m < 0 && errno == EINTR)
                continue;
            if (m <= 0)
                goto out;
            n -= m;
        }
    }
out:
    close(p[0]);
    close(p[1]);
}

static void *run(void *arg) {
    struct direction *d = arg;
    struct link *l = d->link;
    pump(d->src, d->dst, d->idle_ms);
    /* The other side learns of the end; the other direction goes on until its own. */
    shutdown(d->dst, SHUT_WR);
    shutdown(d->src, SHUT_RD);
    free(d);
    pthread_mutex_lock(&l->lock);
    int last = --l->directions_left == 0;
    pthread_mutex_unlock(&l->lock);
    if (last)
        link_free(l);
    return NULL;
}

/* 0 on success; -1 (errno set) when no thread could be started: the caller still owns
 * the descriptors (and the counters are left as they were); 1 (errno set) when only one
 * could: the connection is ended (the relay still owns and closes the descriptors, and
 * counts the connection off). Counters may be NULL. */
int relay_start(int a, int b, int idle_ms, int *c1, int *c2) {
    struct link *l = calloc(1, sizeof *l);
    struct direction *ab = calloc(1, sizeof *ab), *ba = calloc(1, sizeof *ba);
    pthread_attr_t attr;
    pthread_t t;
    int err;
    if (!l || !ab || !ba) {
        free(l), free(ab), free(ba);
        errno = ENOMEM;
        return -1;
    }
    l->fd[0] = a, l->fd[1] = b;
    l->directions_left = 2;
    l->counters[0] = c1, l->counters[1] = c2;
    pthread_mutex_init(&l->lock, NULL);
    *ab = (struct direction){l, a, b, idle_ms};
    *ba = (struct direction){l, b, a, 0};
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 64 * 1024);
    if ((err = pthread_create(&t, &attr, run, ab)) != 0) {
        pthread_attr_destroy(&attr);
        pthread_mutex_destroy(&l->lock);
        free(l), free(ab), free(ba);
        errno = err;
        return -1;
    }
    if ((err = pthread_create(&t, &attr, run, ba)) != 0) {
        /* One direction runs: end the link as if the other had ended at once. */
        free(ba);
        shutdown(b, SHUT_WR);
        shutdown(a, SHUT_RD);
        pthread_mutex_lock(&l->lock);
        int last = --l->directions_left == 0;
        pthread_mutex_unlock(&l->lock);
        if (last)
            link_free(l);
        pthread_attr_destroy(&attr);
        errno = err;
        return 1;
    }
    pthread_attr_destroy(&attr);
    return 0;
}
