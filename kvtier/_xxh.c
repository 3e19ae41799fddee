/* kvtier._xxh: hash many blocks with the system's XXH3, the GIL released for the whole batch.
 *
 * Why. python-xxhash holds the GIL, so threads did not speed up a large commit's hash (6.5 GB/s
 * on 16 threads of the H200 host), and calling libxxhash through ctypes, one block per call,
 * took and dropped the GIL every 4 us and stopped scaling at 4 threads (10.3 GB/s). Here one
 * call hashes a thread's whole share of the batch (kvtier/checksums.py).
 *
 * No header of xxHash is needed at build time: the caller passes the address of XXH3_64bits,
 * looked up in libxxhash by ctypes and checked there against python-xxhash's value.
 *
 *   hash_rows(fn, base, stride, width, rows, out)
 *       fn: address of uint64_t XXH3_64bits(const void *, size_t); base: address of row 0;
 *       stride: bytes between rows; width: bytes per row; rows: int64 row numbers; out: uint64,
 *       written with the hash of each listed row. The caller checks that every row lies inside
 *       its array (this cannot).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef uint64_t (*xxh3_fn)(const void *, size_t);

static PyObject *hash_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "hash_rows takes 6 arguments");
        return NULL;
    }
    void *fnp = PyLong_AsVoidPtr(args[0]);
    void *base = fnp ? PyLong_AsVoidPtr(args[1]) : NULL;
    Py_ssize_t stride = PyLong_AsSsize_t(args[2]);
    Py_ssize_t width = PyLong_AsSsize_t(args[3]);
    if (PyErr_Occurred())
        return NULL;
    if (fnp == NULL || base == NULL || stride < 0 || width < 0) {
        PyErr_SetString(PyExc_ValueError, "hash_rows: null address or negative size");
        return NULL;
    }
    Py_buffer rows, out;
    if (PyObject_GetBuffer(args[4], &rows, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[5], &out, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&rows);
        return NULL;
    }
    if (rows.itemsize != 8 || out.itemsize != 8 || out.len < rows.len) {
        PyBuffer_Release(&rows);
        PyBuffer_Release(&out);
        PyErr_SetString(PyExc_TypeError, "hash_rows: rows int64 and out uint64, out as long");
        return NULL;
    }
    xxh3_fn fn = (xxh3_fn)fnp;
    const int64_t *r = rows.buf;
    uint64_t *o = out.buf;
    Py_ssize_t n = rows.len / 8;
    const uint8_t *b = base;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++)
        o[i] = fn(b + r[i] * stride, (size_t)width);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&rows);
    PyBuffer_Release(&out);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"hash_rows", (PyCFunction)(void (*)(void))hash_rows, METH_FASTCALL,
     "hash_rows(fn, base, stride, width, rows, out): XXH3 of each row, GIL released."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_xxh", "Batch hashing with the system's XXH3 (see _xxh.c).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__xxh(void)
{
    return PyModule_Create(&module);
}
