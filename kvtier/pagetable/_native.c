/* kvtier.pagetable._native: the page table's key hashing and index probing in C.
 *
 * Why. A batch lookup in numpy is ~35 array calls whatever the batch size; on the 2-core
 * development VM each costs 1-3 us, so a 64-key get spent ~55 us on the lookup alone and a
 * 4,096-key one ~140 us (bench/api.py, docs/DESIGN-NOTES.md). These two loops do the same work
 * with no per-call overhead. The numpy implementation in table.py stays the reference and the
 * fallback where this module was not built; tests compare the two on the same tables.
 *
 * Contract (the callers in table.py check shapes and dtypes before calling):
 *   hash_keys(keys, width, out)
 *       keys: n * width bytes; out: n uint64, written. The hash is table.py's _hash: each
 *       8-byte little-endian word (the last one zero-padded) mixed in with a multiply-xorshift,
 *       then a splitmix64 finaliser, seeded with the width.
 *   lookup(index, keycol, width, keys, out)
 *       index: int32 open-addressing table of power-of-two size (-1 empty, -2 tombstone,
 *       otherwise a row); keycol: rows * width bytes; keys: n * width bytes; out: n int64,
 *       written with the row of each key or -1. Linear probing from hash & (size - 1).
 * Neither keeps a reference to its arguments; the GIL is released over batches of 256 or more.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MIX1 0x9E3779B97F4A7C15ULL
#define MIX2 0xBF58476D1CE4E5B9ULL
#define MIX3 0x94D049BB133111EBULL
#define EMPTY (-1)
#define NOGIL_BATCH 256

static inline uint64_t hash_one(const uint8_t *key, Py_ssize_t width)
{
    uint64_t h = (uint64_t)width;
    Py_ssize_t off = 0;
    for (; off + 8 <= width; off += 8) {
        uint64_t w;
        memcpy(&w, key + off, 8);
        h = (h ^ w) * MIX1;
        h ^= h >> 31;
    }
    if (off < width) {
        uint64_t w = 0;
        memcpy(&w, key + off, (size_t)(width - off));
        h = (h ^ w) * MIX1;
        h ^= h >> 31;
    }
    h = (h ^ (h >> 30)) * MIX2;
    h = (h ^ (h >> 27)) * MIX3;
    return h ^ (h >> 31);
}

static int get_buffers(PyObject *const *args, Py_ssize_t nargs, const char *fmt_name,
                       Py_ssize_t want, Py_buffer *bufs, const int *writable)
{
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments", fmt_name, want);
        return -1;
    }
    for (Py_ssize_t i = 0; i < want; i++) {
        if (writable[i] < 0)
            continue;                                  /* an int argument */
        int flags = writable[i] ? PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS : PyBUF_C_CONTIGUOUS;
        if (PyObject_GetBuffer(args[i], &bufs[i], flags) < 0) {
            for (Py_ssize_t j = 0; j < i; j++)
                if (writable[j] >= 0)
                    PyBuffer_Release(&bufs[j]);
            return -1;
        }
    }
    return 0;
}

static void release_buffers(Py_buffer *bufs, Py_ssize_t n, const int *writable)
{
    for (Py_ssize_t i = 0; i < n; i++)
        if (writable[i] >= 0)
            PyBuffer_Release(&bufs[i]);
}

static PyObject *hash_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const int writable[3] = {0, -1, 1};
    Py_buffer b[3];
    if (get_buffers(args, nargs, "hash_keys", 3, b, writable) < 0)
        return NULL;
    Py_ssize_t width = PyLong_AsSsize_t(args[1]);
    if (width <= 0 || (width == -1 && PyErr_Occurred()) || b[0].len % width) {
        release_buffers(b, 3, writable);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "keys are not a whole number of keys of width");
        return NULL;
    }
    Py_ssize_t n = b[0].len / width;
    if (b[2].len < n * 8) {
        release_buffers(b, 3, writable);
        PyErr_SetString(PyExc_ValueError, "out holds fewer than n uint64");
        return NULL;
    }
    const uint8_t *keys = b[0].buf;
    uint64_t *out = b[2].buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        out[i] = hash_one(keys + i * width, width);
    Py_END_ALLOW_THREADS
    release_buffers(b, 3, writable);
    Py_RETURN_NONE;
}

static PyObject *lookup(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const int writable[5] = {0, 0, -1, 0, 1};
    Py_buffer b[5];
    if (get_buffers(args, nargs, "lookup", 5, b, writable) < 0)
        return NULL;
    Py_ssize_t width = PyLong_AsSsize_t(args[2]);
    Py_ssize_t size = b[0].len / 4;
    const char *bad = NULL;
    if (width <= 0 || (width == -1 && PyErr_Occurred()))
        bad = "width must be positive";
    else if (size == 0 || (size & (size - 1)))
        bad = "index size must be a power of two";
    else if (b[1].len % width || b[3].len % width)
        bad = "keycol and keys must be whole numbers of keys";
    else if (b[4].len < (b[3].len / width) * 8)
        bad = "out holds fewer than n int64";
    if (bad) {
        release_buffers(b, 5, writable);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, bad);
        return NULL;
    }
    const int32_t *index = b[0].buf;
    const uint8_t *keycol = b[1].buf, *keys = b[3].buf;
    Py_ssize_t rows = b[1].len / width, n = b[3].len / width;
    int64_t *out = b[4].buf;
    uint64_t mask = (uint64_t)size - 1;
    int corrupt = 0;
    PyThreadState *ts = n >= NOGIL_BATCH ? PyEval_SaveThread() : NULL;
    for (Py_ssize_t i = 0; i < n && !corrupt; i++) {
        const uint8_t *key = keys + i * width;
        uint64_t pos = hash_one(key, width) & mask;
        int64_t found = -1;
        for (Py_ssize_t probes = 0; probes < size; probes++) {
            int32_t r = index[pos];
            if (r == EMPTY)
                break;
            if (r >= 0) {
                if (r >= rows) {
                    corrupt = 1;
                    break;
                }
                if (memcmp(keycol + (Py_ssize_t)r * width, key, (size_t)width) == 0) {
                    found = r;
                    break;
                }
            }
            pos = (pos + 1) & mask;
        }
        out[i] = found;
    }
    if (ts)
        PyEval_RestoreThread(ts);
    release_buffers(b, 5, writable);
    if (corrupt) {
        PyErr_SetString(PyExc_RuntimeError, "page-table index names a row past the key column");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"hash_keys", (PyCFunction)(void (*)(void))hash_keys, METH_FASTCALL,
     "hash_keys(keys, width, out): table.py's key hash of each key into out (uint64)."},
    {"lookup", (PyCFunction)(void (*)(void))lookup, METH_FASTCALL,
     "lookup(index, keycol, width, keys, out): the row of each key, or -1, into out (int64)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native",
    "The page table's key hashing and index probing in C (see _native.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__native(void)
{
    return PyModule_Create(&module);
}
