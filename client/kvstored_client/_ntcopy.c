// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the kvstored project
/* Copies between caller buffers and the daemon's pool with non-temporal (cache-bypassing) stores.
 *
 * glibc's memcpy bypasses the cache only above a threshold derived from the L3 size (181 MiB on
 * a typical VM), so the client's copies of 2 MiB chunks run with cached stores at ~0.6x of a
 * large copy: every destination line is first read into the cache, then written back. Neither
 * side reads the bytes soon after a store or a load (the daemon never touches stored pages; a
 * load's buffer goes to the GPU by DMA), so streaming stores lose nothing and save that read.
 *
 * copy(dst, src) releases the GIL while it copies. Where SSE2 is not available (not x86-64),
 * or for small copies, it is plain memcpy. Optional: without a C compiler the client copies
 * with numpy (kvstored_client.buffers).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define HAVE_STREAM 1
#else
#define HAVE_STREAM 0
#endif

/* Below this, cached stores are faster (the destination may still be in the cache). */
#define STREAM_MIN_BYTES (256 * 1024)

#if HAVE_STREAM
static void stream_copy(char *dst, const char *src, size_t n) {
    /* Align the destination to 16 bytes with a plain copy of the head. */
    size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t blocks = n / 64;
    for (size_t i = 0; i < blocks; i++) {
        __m128i a = _mm_loadu_si128((const __m128i *)(src + 0));
        __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
        __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
        _mm_stream_si128((__m128i *)(dst + 0), a);
        _mm_stream_si128((__m128i *)(dst + 16), b);
        _mm_stream_si128((__m128i *)(dst + 32), c);
        _mm_stream_si128((__m128i *)(dst + 48), d);
        src += 64;
        dst += 64;
    }
    _mm_sfence(); /* the streamed lines are visible before the caller says the copy is done */
    memcpy(dst, src, n - blocks * 64);
}
#endif

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
    size_t n = (size_t)src.len;
    Py_BEGIN_ALLOW_THREADS
#if HAVE_STREAM
    if (n >= STREAM_MIN_BYTES)
        stream_copy((char *)dst.buf, (const char *)src.buf, n);
    else
#endif
        memcpy(dst.buf, src.buf, n);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS,
     "copy(dst, src): copy between equal-sized contiguous buffers, large ones with non-temporal stores."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ntcopy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__ntcopy(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "STREAMING", HAVE_STREAM) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
