// SPDX-License-Identifier: Apache-2.0
// SPDX-FileCopyrightText: Copyright contributors to the kvstored project
//
// The key index: a hash table of a namespace's keys in shared memory, written by the daemon
// (one writer, its event loop) and probed by clients that map it read-only, without locks.
//
// Layout (little-endian): a 64-byte header (magic, version, key bytes, slot count, slot bytes,
// entries), then `slots` slots of `slot_bytes`: a 64-bit tag (0: empty; else the key's hash
// with its low bit set), then the key. Linear probing; removal shifts the entries after the
// hole back (no tombstones), so probes stay short however many keys come and go.
//
// A writer stores a slot's key before its tag (release), a reader loads the tag (acquire),
// compares the key and loads the tag again: a reader racing a writer may miss a key that is
// there (it then asks the daemon) or see a key that has just gone (the load that follows
// misses, as for any chunk evicted after a lookup), never a key that was not there.

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAGIC 0x3130305844494b56ULL  // "VKIDX001"
#define VERSION 1
#define HEADER 64

typedef struct {
    uint64_t magic;
    uint32_t version;
    uint32_t key_bytes;
    uint64_t slots;
    uint64_t slot_bytes;
    uint64_t entries;
} header_t;

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static uint64_t hash_key(const unsigned char *p, Py_ssize_t n) {
    const uint64_t k1 = 0x9E3779B185EBCA87ULL, k2 = 0xC2B2AE3D27D4EB4FULL;
    uint64_t h = 0x27D4EB2F165667C5ULL ^ ((uint64_t)n * k1);
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, p + i, 8);
        h ^= rotl(w * k2, 31) * k1;
        h = rotl(h, 27) * k1 + 0x52DCE729;
    }
    uint64_t tail = 0;
    for (Py_ssize_t j = 0; i + j < n; j++) tail |= (uint64_t)p[i + j] << (8 * j);
    h ^= rotl(tail * k2, 31) * k1;
    h ^= h >> 33;
    h *= 0xFF51AFD7ED558CCDULL;
    h ^= h >> 33;
    h *= 0xC4CEB9FE1A85EC53ULL;
    h ^= h >> 33;
    return h | 1;
}

typedef struct {
    Py_buffer view;
    header_t *hdr;
    unsigned char *slots;
    uint64_t mask;
} table_t;

// Checks the buffer holds a table; `writable`: the daemon's side.
static int open_table(PyObject *obj, table_t *t, int writable) {
    if (PyObject_GetBuffer(obj, &t->view, writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0) return -1;
    if (t->view.len < HEADER) goto bad;
    t->hdr = (header_t *)t->view.buf;
    uint64_t slots = t->hdr->slots, slot_bytes = t->hdr->slot_bytes;
    if (t->hdr->magic != MAGIC || t->hdr->version != VERSION || slots == 0 || (slots & (slots - 1)) ||
        slot_bytes < 8 + (uint64_t)t->hdr->key_bytes || slot_bytes % 8 ||
        (uint64_t)t->view.len < HEADER + slots * slot_bytes)
        goto bad;
    t->slots = (unsigned char *)t->view.buf + HEADER;
    t->mask = slots - 1;
    return 0;
bad:
    PyBuffer_Release(&t->view);
    PyErr_SetString(PyExc_ValueError, "not a key index table (or of another version)");
    return -1;
}

static inline uint64_t *tag_at(table_t *t, uint64_t i) { return (uint64_t *)(t->slots + i * t->hdr->slot_bytes); }
static inline unsigned char *key_at(table_t *t, uint64_t i) { return t->slots + i * t->hdr->slot_bytes + 8; }
static inline uint64_t home_of(table_t *t, uint64_t tag) { return (tag >> 1) & t->mask; }

// Reader: 1 if the key is there, 0 if not (keys of another length are never there).
static int probe_one(table_t *t, const unsigned char *key, Py_ssize_t n) {
    if ((uint64_t)n != t->hdr->key_bytes) return 0;
    uint64_t want = hash_key(key, n);
    uint64_t i = home_of(t, want);
    for (uint64_t step = 0; step <= t->mask; step++, i = (i + 1) & t->mask) {
        uint64_t tag = __atomic_load_n(tag_at(t, i), __ATOMIC_ACQUIRE);
        if (tag == 0) return 0;
        if (tag == want && memcmp(key_at(t, i), key, (size_t)n) == 0) {
            __atomic_thread_fence(__ATOMIC_ACQUIRE);
            if (__atomic_load_n(tag_at(t, i), __ATOMIC_RELAXED) == want) return 1;
        }
    }
    return 0;
}

// Writer: the slot holding the key, or -1 (the empty slot where the probe ended in *empty).
static int64_t find(table_t *t, const unsigned char *key, Py_ssize_t n, uint64_t want, uint64_t *empty) {
    uint64_t i = home_of(t, want);
    for (uint64_t step = 0; step <= t->mask; step++, i = (i + 1) & t->mask) {
        uint64_t tag = *tag_at(t, i);
        if (tag == 0) {
            *empty = i;
            return -1;
        }
        if (tag == want && memcmp(key_at(t, i), key, (size_t)n) == 0) return (int64_t)i;
    }
    *empty = UINT64_MAX;  // full
    return -1;
}

static int key_arg(table_t *t, PyObject *key, const unsigned char **p, Py_ssize_t *n) {
    char *data;
    if (PyBytes_AsStringAndSize(key, &data, n) < 0) return -1;
    if ((uint64_t)*n != t->hdr->key_bytes) {
        PyErr_Format(PyExc_ValueError, "key of %zd bytes in an index of %u-byte keys", *n, t->hdr->key_bytes);
        return -1;
    }
    *p = (const unsigned char *)data;
    return 0;
}

static PyObject *ki_add(PyObject *self, PyObject *args) {
    PyObject *obj, *key;
    if (!PyArg_ParseTuple(args, "OO", &obj, &key)) return NULL;
    table_t t;
    if (open_table(obj, &t, 1) < 0) return NULL;
    const unsigned char *p;
    Py_ssize_t n;
    PyObject *result = NULL;
    if (key_arg(&t, key, &p, &n) < 0) goto out;
    uint64_t want = hash_key(p, n), empty = UINT64_MAX;
    if (find(&t, p, n, want, &empty) >= 0 || empty == UINT64_MAX || t.hdr->entries * 4 >= (t.mask + 1) * 3) {
        result = Py_NewRef(Py_False);  // there already, or too full (probes must end at an empty slot)
        goto out;
    }
    memcpy(key_at(&t, empty), p, (size_t)n);
    __atomic_store_n(tag_at(&t, empty), want, __ATOMIC_RELEASE);
    t.hdr->entries++;
    result = Py_NewRef(Py_True);
out:
    PyBuffer_Release(&t.view);
    return result;
}

static PyObject *ki_remove(PyObject *self, PyObject *args) {
    PyObject *obj, *key;
    if (!PyArg_ParseTuple(args, "OO", &obj, &key)) return NULL;
    table_t t;
    if (open_table(obj, &t, 1) < 0) return NULL;
    const unsigned char *p;
    Py_ssize_t n;
    PyObject *result = NULL;
    if (key_arg(&t, key, &p, &n) < 0) goto out;
    uint64_t empty;
    int64_t found = find(&t, p, n, hash_key(p, n), &empty);
    if (found < 0) {
        result = Py_NewRef(Py_False);
        goto out;
    }
    // Shift back the entries after the hole that probe through it, then empty the last hole.
    uint64_t hole = (uint64_t)found, j = hole;
    for (;;) {
        j = (j + 1) & t.mask;
        uint64_t tag = *tag_at(&t, j);
        if (tag == 0) break;
        uint64_t home = home_of(&t, tag);
        // the entry stays where it is if its home lies cyclically in (hole, j]
        int stays = hole <= j ? (hole < home && home <= j) : (hole < home || home <= j);
        if (stays) continue;
        memcpy(key_at(&t, hole), key_at(&t, j), t.hdr->key_bytes);
        __atomic_store_n(tag_at(&t, hole), tag, __ATOMIC_RELEASE);
        hole = j;
    }
    __atomic_store_n(tag_at(&t, hole), 0, __ATOMIC_RELEASE);
    t.hdr->entries--;
    result = Py_NewRef(Py_True);
out:
    PyBuffer_Release(&t.view);
    return result;
}

// probe(table, keys) -> bytes: one byte per key, 1 where the index holds it.
static PyObject *ki_probe(PyObject *self, PyObject *args) {
    PyObject *obj, *keys;
    if (!PyArg_ParseTuple(args, "OO", &obj, &keys)) return NULL;
    table_t t;
    if (open_table(obj, &t, 0) < 0) return NULL;
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence of bytes");
    PyObject *out = NULL;
    if (seq == NULL) goto done;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq);
    out = PyBytes_FromStringAndSize(NULL, count);
    if (out == NULL) goto done;
    char *hits = PyBytes_AS_STRING(out);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t k = 0; k < count; k++) {
        char *data;
        Py_ssize_t n;
        if (PyBytes_AsStringAndSize(items[k], &data, &n) < 0) {
            Py_CLEAR(out);
            goto done;
        }
        hits[k] = (char)probe_one(&t, (const unsigned char *)data, n);
    }
done:
    Py_XDECREF(seq);
    PyBuffer_Release(&t.view);
    return out;
}

// leading(table, keys) -> int: how many keys, from the first, the index holds (stops at a miss).
static PyObject *ki_leading(PyObject *self, PyObject *args) {
    PyObject *obj, *keys;
    if (!PyArg_ParseTuple(args, "OO", &obj, &keys)) return NULL;
    table_t t;
    if (open_table(obj, &t, 0) < 0) return NULL;
    PyObject *seq = PySequence_Fast(keys, "keys must be a sequence of bytes");
    PyObject *out = NULL;
    if (seq == NULL) goto done;
    Py_ssize_t count = PySequence_Fast_GET_SIZE(seq), k = 0;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (; k < count; k++) {
        char *data;
        Py_ssize_t n;
        if (PyBytes_AsStringAndSize(items[k], &data, &n) < 0) goto done;
        if (!probe_one(&t, (const unsigned char *)data, n)) break;
    }
    out = PyLong_FromSsize_t(k);
done:
    Py_XDECREF(seq);
    PyBuffer_Release(&t.view);
    return out;
}

// init(table, key_bytes, slots): write an empty table's header (the memory is zeroed).
static PyObject *ki_init(PyObject *self, PyObject *args) {
    PyObject *obj;
    unsigned int key_bytes;
    unsigned long long slots;
    if (!PyArg_ParseTuple(args, "OIK", &obj, &key_bytes, &slots)) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(obj, &view, PyBUF_WRITABLE) < 0) return NULL;
    uint64_t slot_bytes = 8 + (((uint64_t)key_bytes + 7) & ~7ULL);
    if (slots == 0 || (slots & (slots - 1)) || (uint64_t)view.len < HEADER + slots * slot_bytes) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "slots must be a power of two that fits the buffer");
        return NULL;
    }
    header_t *hdr = (header_t *)view.buf;
    hdr->version = VERSION;
    hdr->key_bytes = key_bytes;
    hdr->slots = slots;
    hdr->slot_bytes = slot_bytes;
    hdr->entries = 0;
    __atomic_store_n(&hdr->magic, MAGIC, __ATOMIC_RELEASE);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyObject *ki_size(PyObject *self, PyObject *args) {
    unsigned int key_bytes;
    unsigned long long slots;
    if (!PyArg_ParseTuple(args, "IK", &key_bytes, &slots)) return NULL;
    return PyLong_FromUnsignedLongLong(HEADER + slots * (8 + (((uint64_t)key_bytes + 7) & ~7ULL)));
}

static PyObject *ki_entries(PyObject *self, PyObject *args) {
    PyObject *obj;
    if (!PyArg_ParseTuple(args, "O", &obj)) return NULL;
    table_t t;
    if (open_table(obj, &t, 0) < 0) return NULL;
    uint64_t entries = t.hdr->entries;
    PyBuffer_Release(&t.view);
    return PyLong_FromUnsignedLongLong(entries);
}

static PyMethodDef methods[] = {
    {"init", ki_init, METH_VARARGS, "init(table, key_bytes, slots): an empty table's header"},
    {"size", ki_size, METH_VARARGS, "size(key_bytes, slots) -> bytes a table takes"},
    {"add", ki_add, METH_VARARGS, "add(table, key) -> bool (False: there already, or full)"},
    {"remove", ki_remove, METH_VARARGS, "remove(table, key) -> bool (False: not there)"},
    {"probe", ki_probe, METH_VARARGS, "probe(table, keys) -> bytes, 1 per key held"},
    {"leading", ki_leading, METH_VARARGS, "leading(table, keys) -> keys held from the first on"},
    {"entries", ki_entries, METH_VARARGS, "entries(table) -> keys held"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_keyindex", NULL, -1, methods};

PyMODINIT_FUNC PyInit__keyindex(void) { return PyModule_Create(&module); }
