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
 *
 *   hash_slots(fn, arr, slots, out)
 *       The same for a small batch, without hash_rows' Python-side preparation (an address, a
 *       bounds check by numpy's min and max, an index array: ~10 us for 25 one-byte rows on the
 *       dev VM, where python-xxhash's loop took 4.4): arr is the pool's 2-D array, its rows
 *       laid out forwards with contiguous bytes (any other layout is refused: the caller hashes
 *       it in Python); slots is int64, each checked against arr's rows here, all before any is
 *       hashed (IndexError); out uint64, as long. The GIL is kept: a batch this small is done
 *       before another thread could use it.
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


static PyObject *hash_slots(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "hash_slots takes 4 arguments");
        return NULL;
    }
    void *fnp = PyLong_AsVoidPtr(args[0]);
    if (fnp == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "hash_slots: null address");
        return NULL;
    }
    Py_buffer arr, slots, out;
    if (PyObject_GetBuffer(args[1], &arr, PyBUF_STRIDES) < 0)
        return NULL;
    if (arr.ndim != 2 || arr.strides[1] != 1 || arr.strides[0] < 0 || arr.itemsize != 1) {
        PyBuffer_Release(&arr);
        PyErr_SetString(PyExc_ValueError, "hash_slots: a 2-D byte array, rows forwards");
        return NULL;
    }
    if (PyObject_GetBuffer(args[2], &slots, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&arr);
        return NULL;
    }
    if (PyObject_GetBuffer(args[3], &out, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&arr);
        PyBuffer_Release(&slots);
        return NULL;
    }
    PyObject *ret = NULL;
    /* int64 slots ('q' or 'l' where long is 64-bit) and uint64 out ('Q' or 'L') */
    const char *sf = slots.format ? slots.format : "B", *of = out.format ? out.format : "B";
    if (sf[0] == '<' || sf[0] == '=' || sf[0] == '@') sf++;
    if (of[0] == '<' || of[0] == '=' || of[0] == '@') of++;
    if (slots.itemsize != 8 || out.itemsize != 8 || (sf[0] != 'q' && sf[0] != 'l')
            || (of[0] != 'Q' && of[0] != 'L') || out.len < slots.len) {
        PyErr_SetString(PyExc_TypeError, "hash_slots: slots int64 and out uint64, out as long");
        goto done;
    }
    const int64_t *r = slots.buf;
    Py_ssize_t n = slots.len / 8, rows = arr.shape[0], width = arr.shape[1];
    for (Py_ssize_t i = 0; i < n; i++)
        if (r[i] < 0 || r[i] >= rows) {
            PyErr_Format(PyExc_IndexError, "row out of range for %zd blocks", rows);
            goto done;
        }
    xxh3_fn fn = (xxh3_fn)fnp;
    const uint8_t *b = arr.buf;
    uint64_t *o = out.buf;
    for (Py_ssize_t i = 0; i < n; i++)
        o[i] = fn(b + r[i] * arr.strides[0], (size_t)width);
    ret = Py_None;
    Py_INCREF(ret);
done:
    PyBuffer_Release(&arr);
    PyBuffer_Release(&slots);
    PyBuffer_Release(&out);
    return ret;
}

static PyMethodDef methods[] = {
    {"hash_rows", (PyCFunction)(void (*)(void))hash_rows, METH_FASTCALL,
     "hash_rows(fn, base, stride, width, rows, out): XXH3 of each row, GIL released."},
    {"hash_slots", (PyCFunction)(void (*)(void))hash_slots, METH_FASTCALL,
     "hash_slots(fn, arr, slots, out): XXH3 of arr[s] for each slot s, checked; GIL kept."},
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
