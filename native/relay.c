/* The peer-credential relay's byte pump (daemon/sandboxd/transport.py), in C.
 *
 * The daemon accepts each client on its public socket itself (to read SO_PEERCRED) and
 * relays the connection to its private gRPC socket. Done by two Python threads, every
 * message woke a thread that had to take the GIL before it could splice again: half a
 * millisecond of a leased command's five, more when the interpreter was busy. Here each
 * direction is a thread outside the interpreter, splicing through a pipe, so the bytes
 * never enter user space either.
 *
 * relay_start(a, b) takes ownership of both descriptors: they are closed when both
 * directions have ended. Built as a shared library by `make native` (libc only). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#define CHUNK (1 << 20)

struct link {
    int fd[2];
    int directions_left;
    pthread_mutex_t lock;
};

struct direction {
    struct link *link;
    int src, dst;
};

static void pump(int src, int dst) {
    int p[2];
    if (pipe2(p, O_CLOEXEC) != 0)
        return;
    (void)fcntl(p[1], F_SETPIPE_SZ, CHUNK); /* fewer splices for bulk output; best effort */
    for (;;) {
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
    pump(d->src, d->dst);
    /* The other side learns of the end; the other direction goes on until its own. */
    shutdown(d->dst, SHUT_WR);
    shutdown(d->src, SHUT_RD);
    free(d);
    pthread_mutex_lock(&l->lock);
    int last = --l->directions_left == 0;
    pthread_mutex_unlock(&l->lock);
    if (last) {
        close(l->fd[0]);
        close(l->fd[1]);
        pthread_mutex_destroy(&l->lock);
        free(l);
    }
    return NULL;
}

/* 0 on success; -1 (errno set) when no thread could be started: the caller still owns
 * the descriptors then; 1 (errno set) when only one could: the connection is ended
 * (the relay still owns and closes the descriptors). */
int relay_start(int a, int b) {
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
    pthread_mutex_init(&l->lock, NULL);
    *ab = (struct direction){l, a, b};
    *ba = (struct direction){l, b, a};
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
        if (last) {
            close(a);
            close(b);
            pthread_mutex_destroy(&l->lock);
            free(l);
        }
        pthread_attr_destroy(&attr);
        errno = err;
        return 1;
    }
    pthread_attr_destroy(&attr);
    return 0;
}
