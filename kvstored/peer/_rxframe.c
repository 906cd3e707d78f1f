// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the kvstored project
/* A TCP frame's payload read straight into its slot and hashed as it lands, in one call that
 * holds no GIL (for the data plane's threads, kvstored/peer/tcp.py).
 *
 * In Python each step of a read (recvmsg_into, then xxhash of what it read, then poll) takes and
 * gives back the GIL, and with the event loop and a second data thread wanting it too those
 * hand-offs cost more CPU than the hashing. Here one call reads a whole frame (payload, its SUM
 * and the next frame's HEAD) in steps of `step` bytes, hashing each step right after the kernel
 * copied it (it is still in the CPU cache), waiting with poll() for `step` bytes (SO_RCVLOWAT).
 *
 * xxh3-64 comes from the system's libxxhash (Debian's libxxhash0, which apt itself needs), opened
 * at import: without it the module does not import and tcp.py reads in Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>

#define IOV_AT_MOST 1024 /* iovecs per recvmsg (the kernel's UIO_MAXIOV) */

/* libxxhash's XXH3 streaming API (xxhash.h, 0.8), declared here: no header needed to build. */
typedef struct XXH3_state_s XXH3_state_t;
static XXH3_state_t *(*xxh3_create)(void);
static int (*xxh3_free)(XXH3_state_t *);
static int (*xxh3_reset)(XXH3_state_t *);
static int (*xxh3_update)(XXH3_state_t *, const void *, size_t);
static uint64_t (*xxh3_digest)(const XXH3_state_t *);

enum { DONE = 0, CLOSED = 1, TIMED_OUT = 2, FAILED = 3 };

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* what Python's time.monotonic() reads */
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

typedef struct {
    char **base;
    size_t *len;
    Py_ssize_t count;
    size_t total;
    struct iovec *iov; /* IOV_AT_MOST of them */
} Bufs;

/* A cursor over the buffers: where the stream's byte `pos` lies. */
typedef struct {
    Py_ssize_t i;
    size_t offset;
} Cursor;

static void advance(const Bufs *bufs, Cursor *at, size_t n) {
    while (n && at->i < bufs->count) { /* (no buffer is empty: recv_frame leaves those out) */
        size_t room = bufs->len[at->i] - at->offset;
        size_t step = n < room ? n : room;
        at->offset += step;
        n -= step;
        if (at->offset == bufs->len[at->i]) {
            at->i++;
            at->offset = 0;
        }
    }
}

/* Fill `bufs` from `fd` (non-blocking); hash the first `payload` bytes as they land. Sets
 * *moved; returns DONE, CLOSED (the peer closed or the socket was shut down), TIMED_OUT or
 * FAILED (errno in *error). */
static int receive(int fd, const Bufs *bufs, size_t payload, size_t step, double end, XXH3_state_t *state,
                   size_t *moved, int *error) {
    Cursor read_at = {0, 0};
    size_t pos = 0;
    int lowat = 0;
    while (pos < bufs->total) {
        int n_iov = 0;
        size_t want = step;
        Cursor c = read_at;
        while (want && c.i < bufs->count && n_iov < IOV_AT_MOST) {
            size_t take = bufs->len[c.i] - c.offset;
            if (take > want)
                take = want;
            bufs->iov[n_iov].iov_base = bufs->base[c.i] + c.offset;
            bufs->iov[n_iov].iov_len = take;
            n_iov++;
            want -= take;
            c.i++;
            c.offset = 0;
        }
        struct msghdr msg = {0};
        msg.msg_iov = bufs->iov;
        msg.msg_iovlen = (size_t)n_iov;
        ssize_t n = recvmsg(fd, &msg, MSG_DONTWAIT);
        if (n > 0) {
            /* what this read landed is the start of its iovecs: hash its payload part */
            size_t unhashed = pos < payload ? (payload - pos < (size_t)n ? payload - pos : (size_t)n) : 0;
            for (int k = 0; unhashed; k++) {
                size_t part = bufs->iov[k].iov_len < unhashed ? bufs->iov[k].iov_len : unhashed;
                xxh3_update(state, bufs->iov[k].iov_base, part);
                unhashed -= part;
            }
            pos += (size_t)n;
            advance(bufs, &read_at, (size_t)n);
            *moved = pos;
            continue;
        }
        if (n == 0)
            return CLOSED;
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            *error = errno;
            return FAILED;
        }
        size_t rest = bufs->total - pos;
        int wanted = (int)(rest < step ? rest : step);
        if (wanted != lowat) { /* woken once this much is there, not at every segment */
            setsockopt(fd, SOL_SOCKET, SO_RCVLOWAT, &wanted, sizeof wanted);
            lowat = wanted;
        }
        double left = end - now_s();
        if (left <= 0)
            return TIMED_OUT;
        struct pollfd pfd = {fd, POLLIN, 0};
        int ms = left > 60.0 ? 60000 : (int)(left * 1000.0) + 1; /* (a far deadline: poll again) */
        if (poll(&pfd, 1, ms) < 0 && errno != EINTR) {
            *error = errno;
            return FAILED;
        }
    }
    return DONE;
}

static PyObject *recv_frame(PyObject *self, PyObject *args) {
    int fd;
    PyObject *seq;
    Py_ssize_t payload, step;
    double end;
    if (!PyArg_ParseTuple(args, "iOnnd", &fd, &seq, &payload, &step, &end))
        return NULL;
    if (payload < 0 || step <= 0 || step > INT_MAX) {
        PyErr_Format(PyExc_ValueError, "payload %zd, step %zd", payload, step);
        return NULL;
    }
    PyObject *items = PySequence_Fast(seq, "buffers must be a sequence");
    if (items == NULL)
        return NULL;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(items);
    Py_buffer *views = PyMem_Calloc((size_t)count + 1, sizeof(Py_buffer));
    Bufs bufs = {
        .base = PyMem_Calloc((size_t)count + 1, sizeof(char *)),
        .len = PyMem_Calloc((size_t)count + 1, sizeof(size_t)),
        .count = 0,
        .total = 0,
        .iov = PyMem_Calloc(IOV_AT_MOST, sizeof(struct iovec)),
    };
    PyObject *result = NULL;
    XXH3_state_t *state = NULL;
    Py_ssize_t n_views = 0;
    if (views == NULL || bufs.base == NULL || bufs.len == NULL || bufs.iov == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(items, i), &views[i], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto out;
        n_views++;
        if (views[i].len == 0)
            continue; /* (an empty buffer takes no byte; the cursors must never stop on one) */
        bufs.base[bufs.count] = views[i].buf;
        bufs.len[bufs.count] = (size_t)views[i].len;
        bufs.total += (size_t)views[i].len;
        bufs.count++;
    }
    if ((size_t)payload > bufs.total) {
        PyErr_SetString(PyExc_ValueError, "the payload is longer than the buffers");
        goto out;
    }
    state = xxh3_create();
    if (state == NULL) {
        PyErr_NoMemory();
        goto out;
    }
    size_t moved = 0;
    int error = 0, outcome;
    xxh3_reset(state);
    Py_BEGIN_ALLOW_THREADS
    outcome = receive(fd, &bufs, (size_t)payload, (size_t)step, end, state, &moved, &error);
    Py_END_ALLOW_THREADS
    result = Py_BuildValue("inKi", outcome, (Py_ssize_t)moved, (unsigned long long)xxh3_digest(state), error);
out:
    if (state != NULL)
        xxh3_free(state);
    for (Py_ssize_t i = 0; i < n_views; i++)
        PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(bufs.base);
    PyMem_Free(bufs.len);
    PyMem_Free(bufs.iov);
    Py_DECREF(items);
    return result;
}

static PyObject *xxh3(PyObject *self, PyObject *args) {
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "y*", &data))
        return NULL;
    XXH3_state_t *state = xxh3_create();
    if (state == NULL) {
        PyBuffer_Release(&data);
        return PyErr_NoMemory();
    }
    xxh3_reset(state);
    xxh3_update(state, data.buf, (size_t)data.len);
    unsigned long long digest = (unsigned long long)xxh3_digest(state);
    xxh3_free(state);
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLongLong(digest);
}

static PyMethodDef methods[] = {
    {"xxh3", xxh3, METH_VARARGS,
     "xxh3(data) -> the xxh3-64 of data as this module computes it (so an importer can check the system's "
     "libxxhash agrees with the chunk format's checksum)."},
    {"recv_frame", recv_frame, METH_VARARGS,
     "recv_frame(fd, buffers, payload, step, end) -> (outcome, moved, xxh3 of the payload, errno): fill every "
     "buffer from the non-blocking socket fd, `step` bytes per read at most, hashing its first `payload` bytes as "
     "they land, until time.monotonic() `end`. outcome: 0 done, 1 the peer closed (or shut down), 2 timed out, 3 "
     "failed (errno). The GIL is not held meanwhile."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rxframe", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rxframe(void) {
    void *lib = dlopen("libxxhash.so.0", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        PyErr_Format(PyExc_ImportError, "libxxhash.so.0: %s", dlerror());
        return NULL;
    }
    xxh3_create = (XXH3_state_t * (*)(void)) dlsym(lib, "XXH3_createState");
    xxh3_free = (int (*)(XXH3_state_t *))dlsym(lib, "XXH3_freeState");
    xxh3_reset = (int (*)(XXH3_state_t *))dlsym(lib, "XXH3_64bits_reset");
    xxh3_update = (int (*)(XXH3_state_t *, const void *, size_t))dlsym(lib, "XXH3_64bits_update");
    xxh3_digest = (uint64_t(*)(const XXH3_state_t *))dlsym(lib, "XXH3_64bits_digest");
    if (!xxh3_create || !xxh3_free || !xxh3_reset || !xxh3_update || !xxh3_digest) {
        PyErr_SetString(PyExc_ImportError, "libxxhash.so.0 lacks the XXH3 streaming functions");
        return NULL;
    }
    return PyModule_Create(&module);
}
