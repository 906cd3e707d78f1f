// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the kvstored project
/* memcpy that survives SIGBUS.
 *
 * The daemon maps client region files. A client that shrinks its file while the daemon copies
 * makes the touched pages vanish, and the copy faults with SIGBUS, which would kill the daemon
 * and every other client's cache with it. Here the copying thread arms a per-thread jump buffer;
 * a SIGBUS raised while it is armed jumps back and the copy reports failure. A SIGBUS anywhere
 * else gets the previous disposition (by default: the process dies, as it should).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <signal.h>
#include <string.h>

/* volatile + barriers: memcpy is a builtin, so without them the compiler may drop or move the
 * stores around it (the handler would then find nothing armed). */
static __thread sigjmp_buf *volatile armed = NULL;
#define BARRIER() __asm__ __volatile__("" ::: "memory")
static struct sigaction previous;

static void on_sigbus(int sig, siginfo_t *info, void *context) {
    sigjmp_buf *target = armed;
    if (target != NULL) {
        armed = NULL;
        siglongjmp(*target, 1);
    }
    sigaction(SIGBUS, &previous, NULL); /* not a guarded copy: fault as if we were not here */
}

static PyObject *copy(PyObject *self, PyObject *args) {
    Py_buffer dst, src;
    if (!PyArg_ParseTuple(args, "w*y*", &dst, &src))
        return NULL;
    if (src.len != dst.len) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        PyErr_Format(PyExc_ValueError, "copy of %zd bytes into %zd", src.len, dst.len);
        return NULL;
    }
    volatile int faulted = 0;
    sigjmp_buf jump;
    Py_BEGIN_ALLOW_THREADS
    if (sigsetjmp(jump, 1) == 0) {
        armed = &jump;
        BARRIER();
        memcpy(dst.buf, src.buf, (size_t)src.len);
        BARRIER();
        armed = NULL;
    } else {
        faulted = 1;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    if (faulted) {
        PyErr_SetString(PyExc_BufferError, "bus error during copy: a mapped file shrank");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS, "copy(dst, src): memcpy between equal-sized buffers; BufferError on SIGBUS."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_safecopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__safecopy(void) {
    struct sigaction action;
    memset(&action, 0, sizeof(action));
    action.sa_sigaction = on_sigbus;
    action.sa_flags = SA_SIGINFO | SA_NODEFER;
    sigemptyset(&action.sa_mask);
    if (sigaction(SIGBUS, &action, &previous) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyModule_Create(&module);
}
