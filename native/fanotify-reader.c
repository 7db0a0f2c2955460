/* The reading side of file-access recording (daemon/sandboxd/filewatch.py), in C.
 *
 * A test run opens thousands of files: per event, the daemon reads the event, asks the
 * kernel for the path of its descriptor, closes it and counts the path. Done in Python
 * that cost ~10 us an event, on the GIL, beside the call; here the whole read of a
 * queue runs in one ctypes call (which releases the GIL) and the counting stays in C.
 * Python reads the table once, when the command has ended.
 *
 * One `struct watch` per fanotify group: fw_drain is called by its reader thread only;
 * fw_note, fw_export and fw_reset may come from others (a mutex orders them).
 * Built as a shared library by `make native` (libc only). */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/fanotify.h>
#include <sys/stat.h>
#include <unistd.h>

/* A directory's cache key is handle_type then the handle's bytes, read in one piece. */
_Static_assert(offsetof(struct file_handle, f_handle) == offsetof(struct file_handle, handle_type) + 4,
               "struct file_handle: handle_type right before the handle's bytes");

#define READ_BYTES (256 * 1024)
#define MAX_MOUNTS 64
#define DIR_SLOTS 64 /* directories resolved per read of the queue (FID mode) */
#define MAX_HANDLE 128 /* MAX_HANDLE_SZ */

struct entry {
    char *path; /* NULL: a free slot */
    uint32_t len;
    uint32_t opens;
    uint32_t writes;
    uint64_t hash;
};

struct mount {
    uint64_t id;
    char path[PATH_MAX];
};

/* FID mode: a directory's handle, resolved to its path once per read of the queue
 * (never longer: a directory renamed later must not keep its old name). */
struct dir_slot {
    uint32_t klen; /* 0: free */
    uint64_t hash;
    unsigned char key[4 + MAX_HANDLE]; /* handle_type, then the handle's bytes */
    char *path;
    uint32_t plen;
};

struct watch {
    int fan_fd;
    int fid;      /* events name a directory handle and a name, no descriptor */
    int mount_fd; /* FID mode: the marked mount, to open directory handles through */
    uint64_t unresolved; /* FID mode: events whose directory was gone before it was read */
    uint64_t unnamed;    /* events that could not be named otherwise (a path too long, an error) */
    struct dir_slot dirs[DIR_SLOTS];
    pthread_mutex_t lock;
    struct entry *table;
    size_t capacity, count, max_paths;
    uint64_t dropped;
    int overflowed;
    int only_mount; /* one marked mount: every event is through mounts[0] */
    size_t mounts_len;
    struct mount mounts[MAX_MOUNTS];
    char *buf;
};

static uint64_t fnv1a(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 1099511628211ULL;
    }
    return h;
}

void *fw_new(size_t max_paths) {
    struct watch *w = calloc(1, sizeof *w);
    if (!w)
        return NULL;
    w->fan_fd = -1;
    w->mount_fd = -1;
    w->max_paths = max_paths;
    w->capacity = 1024;
    w->table = calloc(w->capacity, sizeof *w->table);
    w->buf = malloc(READ_BYTES);
    if (!w->table || !w->buf || pthread_mutex_init(&w->lock, NULL) != 0) {
        free(w->table);
        free(w->buf);
        free(w);
        return NULL;
    }
    return w;
}

void fw_set_fd(void *handle, int fan_fd) { ((struct watch *)handle)->fan_fd = fan_fd; }

/* FID mode (a group made with FAN_REPORT_DFID_NAME, one marked mount): `mount_fd` is a
 * descriptor of that mount's root (not O_PATH: open_by_handle_at refuses those), kept
 * open by the caller while the watch reads. */
int fw_set_fid(void *handle, int mount_fd) {
    struct watch *w = handle;
    pthread_mutex_lock(&w->lock);
    int result = -EINVAL;
    if (w->only_mount) { /* the directory cache has no filesystem id in its key */
        w->fid = 1;
        w->mount_fd = mount_fd;
        result = 0;
    }
    pthread_mutex_unlock(&w->lock);
    return result;
}

uint64_t fw_unresolved(void *handle) {
    struct watch *w = handle;
    pthread_mutex_lock(&w->lock);
    uint64_t n = w->unresolved;
    pthread_mutex_unlock(&w->lock);
    return n;
}

uint64_t fw_unnamed(void *handle) {
    struct watch *w = handle;
    pthread_mutex_lock(&w->lock);
    uint64_t n = w->unnamed;
    pthread_mutex_unlock(&w->lock);
    return n;
}

/* A marked mount: its id (statx STATX_MNT_ID) and its path inside the sandbox. */
int fw_add_mount(void *handle, uint64_t mount_id, const char *sandbox_path) {
    struct watch *w = handle;
    if (strlen(sandbox_path) >= PATH_MAX)
        return -EINVAL;
    pthread_mutex_lock(&w->lock); /* the reader may already be draining */
    int result = -EINVAL;
    if (w->mounts_len < MAX_MOUNTS) {
        w->mounts[w->mounts_len].id = mount_id;
        strcpy(w->mounts[w->mounts_len].path, sandbox_path);
        w->mounts_len++;
        result = 0;
    }
    pthread_mutex_unlock(&w->lock);
    return result;
}

/* Every event is through this one mount: no mount id asked per event. */
int fw_only_mount(void *handle, const char *sandbox_path) {
    struct watch *w = handle;
    if (strlen(sandbox_path) >= PATH_MAX)
        return -EINVAL;
    pthread_mutex_lock(&w->lock);
    w->mounts[0].id = 0;
    strcpy(w->mounts[0].path, sandbox_path);
    w->mounts_len = 1;
    w->only_mount = 1;
    pthread_mutex_unlock(&w->lock);
    return 0;
}

static void clear(struct watch *w) {
    for (size_t i = 0; i < w->capacity; i++) {
        free(w->table[i].path);
        w->table[i].path = NULL;
    }
    w->count = 0;
}

static void forget_dirs(struct watch *w) {
    for (size_t i = 0; i < DIR_SLOTS; i++) {
        free(w->dirs[i].path);
        w->dirs[i].path = NULL;
        w->dirs[i].klen = 0;
    }
}

void fw_free(void *handle) {
    struct watch *w = handle;
    if (!w)
        return;
    clear(w);
    forget_dirs(w);
    free(w->table);
    free(w->buf);
    pthread_mutex_destroy(&w->lock);
    free(w);
}

static int grow(struct watch *w) {
    size_t capacity = w->capacity * 2;
    struct entry *table = calloc(capacity, sizeof *table);
    if (!table)
        return -ENOMEM;
    for (size_t i = 0; i < w->capacity; i++) {
        struct entry *e = &w->table[i];
        if (!e->path)
            continue;
        size_t j = e->hash & (capacity - 1);
        while (table[j].path)
            j = (j + 1) & (capacity - 1);
        table[j] = *e;
    }
    free(w->table);
    w->table = table;
    w->capacity = capacity;
    return 0;
}

/* Counts one event on `path` (lock held). */
static void note(struct watch *w, const char *path, size_t len, uint64_t mask) {
    uint64_t h = fnv1a(path, len);
    size_t i = h & (w->capacity - 1);
    struct entry *e;
    for (;;) {
        e = &w->table[i];
        if (!e->path)
            break;
        if (e->hash == h && e->len == len && memcmp(e->path, path, len) == 0)
            goto count;
        i = (i + 1) & (w->capacity - 1);
    }
    if (w->count >= w->max_paths) {
        w->dropped++;
        return;
    }
    if ((w->count + 1) * 2 > w->capacity) {
        if (grow(w) != 0) {
            w->dropped++;
            return;
        }
        note(w, path, len, mask);
        return;
    }
    e->path = malloc(len + 1);
    if (!e->path) {
        w->dropped++;
        return;
    }
    memcpy(e->path, path, len);
    e->path[len] = 0;
    e->len = (uint32_t)len;
    e->hash = h;
    e->opens = e->writes = 0;
    w->count++;
count:
    if (mask & FAN_OPEN)
        e->opens++;
    if (mask & (FAN_MODIFY | FAN_CLOSE_WRITE))
        e->writes++;
}

void fw_note(void *handle, const char *path, size_t len, uint64_t mask) {
    struct watch *w = handle;
    pthread_mutex_lock(&w->lock);
    note(w, path, len, mask);
    pthread_mutex_unlock(&w->lock);
}

static uint64_t fdinfo_mount_id(int fd) {
    char name[64], line[256];
    snprintf(name, sizeof name, "/proc/self/fdinfo/%d", fd);
    FILE *f = fopen(name, "re");
    uint64_t id = UINT64_MAX;
    if (!f)
        return id;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "mnt_id: %lu", &id) == 1)
            break;
    fclose(f);
    return id;
}

static uint64_t mount_id(int fd) {
    struct statx stx;
    if (statx(fd, "", AT_EMPTY_PATH, STATX_MNT_ID, &stx) == 0 && (stx.stx_mask & STATX_MNT_ID))
        return stx.stx_mnt_id;
    return fdinfo_mount_id(fd); /* kernels before 5.8 */
}

/* The path of an event's descriptor as the sandbox sees it, into `out`; its length, or
 * -1. The watch holds the sandbox's mount namespace until it stops, so the kernel names
 * the path from the sandbox's root. Were the namespace gone, it would name it relative
 * to the mount's own root: such a path is put back under the mount's sandbox path here
 * (a defence; ambiguous for a directory named like the mount's path). */
static ssize_t sandbox_path(struct watch *w, int fd, char *out) {
    char link[64], path[PATH_MAX];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n < 0)
        return -1;
    path[n] = 0;
    const char *mount = NULL;
    if (w->only_mount) {
        mount = w->mounts[0].path;
    } else if (w->mounts_len) {
        uint64_t id = mount_id(fd);
        for (size_t i = 0; i < w->mounts_len; i++)
            if (w->mounts[i].id == id) {
                mount = w->mounts[i].path;
                break;
            }
    }
    size_t mlen = mount ? strlen(mount) : 0;
    while (mlen > 1 && mount[mlen - 1] == '/')
        mlen--;
    int as_is = !mount || (mlen == 1 && mount[0] == '/') ||
                (strncmp(path, mount, mlen) == 0 && (path[mlen] == 0 || path[mlen] == '/'));
    if (as_is) {
        memcpy(out, path, (size_t)n + 1);
        return n;
    }
    size_t tail = (n == 1 && path[0] == '/') ? 0 : (size_t)n;
    if (mlen + tail >= PATH_MAX)
        return -1;
    memcpy(out, mount, mlen);
    memcpy(out + mlen, path, tail);
    out[mlen + tail] = 0;
    return (ssize_t)(mlen + tail);
}

/* FID mode: the path of the directory whose handle is `fh`, as the sandbox sees it
 * (resolved through the marked mount once per read of the queue); NULL when it cannot
 * be (removed before its events were read: ESTALE). Lock held. */
static struct dir_slot *directory(struct watch *w, struct file_handle *fh, int *gone) {
    size_t klen = 4 + fh->handle_bytes;
    const unsigned char *key = (const unsigned char *)&fh->handle_type; /* type, then bytes */
    uint64_t h = fnv1a((const char *)key, klen);
    size_t i = h & (DIR_SLOTS - 1), probes = 0;
    for (; w->dirs[i].klen; i = (i + 1) & (DIR_SLOTS - 1)) {
        struct dir_slot *d = &w->dirs[i];
        if (d->hash == h && d->klen == klen && memcmp(d->key, key, klen) == 0)
            return d;
        if (++probes == DIR_SLOTS) { /* full: start over */
            forget_dirs(w);
            i = h & (DIR_SLOTS - 1);
            break;
        }
    }
    int fd = open_by_handle_at(w->mount_fd, fh, O_PATH | O_CLOEXEC);
    if (fd < 0) {
        *gone = errno == ESTALE || errno == ENOENT;
        return NULL;
    }
    char path[PATH_MAX];
    ssize_t n = sandbox_path(w, fd, path);
    close(fd);
    if (n < 0)
        return NULL;
    struct dir_slot *d = &w->dirs[i];
    d->path = malloc((size_t)n + 1);
    if (!d->path)
        return NULL;
    memcpy(d->path, path, (size_t)n + 1);
    d->plen = (uint32_t)n;
    memcpy(d->key, key, klen);
    d->klen = (uint32_t)klen;
    d->hash = h;
    return d;
}

/* FID mode: one event's directory handle and name, counted as dir + "/" + name. An
 * event that cannot be named is counted as unresolved (its directory is gone) or
 * unnamed (anything else): the record then says it is incomplete. */
static void note_fid(struct watch *w, const struct fanotify_event_metadata *m, char *path) {
    const char *p = (const char *)m + m->metadata_len, *end = (const char *)m + m->event_len;
    while (p + sizeof(struct fanotify_event_info_header) <= end) {
        struct fanotify_event_info_header hdr;
        memcpy(&hdr, p, sizeof hdr); /* records are 4-byte aligned only by the kernel's word */
        if (hdr.len < sizeof hdr || p + hdr.len > end)
            break;
        const size_t fixed = sizeof(struct fanotify_event_info_fid) + sizeof(struct file_handle);
        if (hdr.info_type == FAN_EVENT_INFO_TYPE_DFID_NAME && hdr.len > fixed) {
            const struct fanotify_event_info_fid *fid = (const void *)p;
            struct file_handle *fh = (struct file_handle *)fid->handle;
            if (fh->handle_bytes > MAX_HANDLE || fixed + fh->handle_bytes >= hdr.len)
                break;
            const char *name = (const char *)fh->f_handle + fh->handle_bytes;
            size_t nlen = strnlen(name, (size_t)(p + hdr.len - name));
            if (name + nlen >= p + hdr.len) /* not NUL-terminated within the record */
                break;
            int gone = 0;
            struct dir_slot *d = directory(w, fh, &gone);
            if (!d) {
                if (gone)
                    w->unresolved++;
                else
                    w->unnamed++;
                return;
            }
            int root = d->plen == 1 && d->path[0] == '/';
            size_t len = d->plen + (root ? 0 : 1) + nlen;
            if (len >= PATH_MAX)
                break;
            memcpy(path, d->path, d->plen);
            if (!root)
                path[d->plen] = '/';
            memcpy(path + d->plen + (root ? 0 : 1), name, nlen + 1);
            note(w, path, len, m->mask);
            return;
        }
        p += hdr.len;
    }
    w->unnamed++;
}

/* One read of the group's queue, every event in it counted and its descriptor closed.
 * Returns how many events were read (0: none were queued), or -errno. The lock is held
 * from the read to the last count: a drain that finds the queue empty knows that every
 * event read before it, by any thread, is counted (a caller may drain for itself while
 * the reader thread drains too). */
long fw_drain(void *handle) {
    struct watch *w = handle;
    pthread_mutex_lock(&w->lock);
    ssize_t len = read(w->fan_fd, w->buf, READ_BYTES);
    if (len < 0) {
        int err = errno;
        pthread_mutex_unlock(&w->lock);
        return err == EAGAIN ? 0 : -err;
    }
    char path[PATH_MAX];
    long events = 0;
    struct fanotify_event_metadata *m = (struct fanotify_event_metadata *)w->buf;
    while (FAN_EVENT_OK(m, len)) {
        events++;
        if (m->mask & FAN_Q_OVERFLOW) {
            w->overflowed = 1; /* no object: the record says events were lost */
        } else if (w->fid && m->fd == FAN_NOFD && m->event_len > m->metadata_len) {
            note_fid(w, m, path);
        } else if (m->fd >= 0) {
            ssize_t n = sandbox_path(w, m->fd, path);
            if (n >= 0)
                note(w, path, (size_t)n, m->mask);
            else
                w->unnamed++; /* e.g. a path longer than PATH_MAX */
            close(m->fd);
        } else {
            w->unnamed++;
        }
        m = FAN_EVENT_NEXT(m, len);
    }
    if (w->fid)
        forget_dirs(w);
    pthread_mutex_unlock(&w->lock);
    return events;
}

static int by_path(const void *a, const void *b) {
    return strcmp((*(const struct entry *const *)a)->path, (*(const struct entry *const *)b)->path);
}

/* The table, in byte order of the paths, into `out`: a u64 count n, n pairs of u32
 * (opens, writes), then the n paths, each ended by a NUL. Returns the bytes written,
 * or (nothing written) the size needed when over `capacity`; -ENOMEM. */
long fw_export(void *handle, char *out, size_t capacity) {
    struct watch *w = handle;
    pthread_mutex_lock(&w->lock);
    size_t need = 8 + w->count * 8;
    for (size_t i = 0; i < w->capacity; i++)
        if (w->table[i].path)
            need += w->table[i].len + 1;
    long result = (long)need;
    if (need <= capacity) {
        struct entry **sorted = malloc((w->count ? w->count : 1) * sizeof *sorted);
        if (!sorted) {
            result = -ENOMEM;
        } else {
            size_t n = 0;
            for (size_t i = 0; i < w->capacity; i++)
                if (w->table[i].path)
                    sorted[n++] = &w->table[i];
            qsort(sorted, n, sizeof *sorted, by_path);
            uint64_t count = n;
            memcpy(out, &count, 8);
            uint32_t *counts = (uint32_t *)(out + 8);
            char *p = out + 8 + n * 8;
            for (size_t i = 0; i < n; i++) {
                counts[2 * i] = sorted[i]->opens;
                counts[2 * i + 1] = sorted[i]->writes;
                memcpy(p, sorted[i]->path, sorted[i]->len + 1);
                p += sorted[i]->len + 1;
            }
            free(sorted);
        }
    }
    pthread_mutex_unlock(&w->lock);
    return result;
}

uint64_t fw_dropped(void *handle) { return ((struct watch *)handle)->dropped; }

int fw_overflowed(void *handle) { return ((struct watch *)handle)->overflowed; }

/* A new record from here on (the next command of a kept watch). */
void fw_reset(void *handle) {
    struct watch *w = handle;
    pthread_mutex_lock(&w->lock);
    clear(w);
    w->dropped = 0;
    w->overflowed = 0;
    w->unresolved = 0;
    w->unnamed = 0;
    pthread_mutex_unlock(&w->lock);
}
