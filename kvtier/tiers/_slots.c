/* kvtier.tiers._slots: SlotPool.write's bounds check and row copy in one C call.
 *
 * Why. On the dev VM a put's write of ~25 one-byte blocks (the replay's metadata-only case)
 * cost ~15 us: the slots' min and max (two numpy reductions of ~4 us each), the cast and the
 * fancy assignment, for work of well under a microsecond (issue 18, the replay's CPU).
 * host.py keeps the numpy version as the fallback and the reference;
 * tests/test_host.py::test_the_c_write_writes_what_numpy_writes writes the same slots both
 * ways and compares the pools.
 *
 *   write_rows(array u8[p, w], slots i64[n] or i32[n], data u8[n, w]) -> int
 *       1: every slot is in 0..p-1, and data[i] was copied into array[slots[i]] for each i
 *       in order (a slot listed twice ends with its last row, as numpy's assignment does).
 *       0: some slot is out of range; nothing was written.
 *       -1: not handled here (data's bytes overlap the pool's); nothing was written, the
 *       caller takes numpy's path, which copies the source first.
 *       TypeError when an argument is not a C-contiguous array of the stated shape and items
 *       (the caller takes numpy's path, which also broadcasts).
 *
 * No reference to any argument is kept; the GIL is held (the engine serialises calls).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "../coherence/cviews.h"

static PyObject *write_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "write_rows takes 3 arguments");
        return NULL;
    }
    Views v = {.n = 0};
    Py_ssize_t p, w, n, dn, dw;
    uint8_t *array = view(&v, args[0], 1, 1, &p, &w, "array");
    if (array == NULL) {
        views_release(&v);
        return NULL;
    }
    /* The slots: int64 or int32, told apart by their format (never an unsigned type, whose
     * large values a cast would turn negative). */
    Py_buffer *sb = &v.b[v.n];
    if (PyObject_GetBuffer(args[1], sb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        views_release(&v);
        return NULL;
    }
    v.n++;
    char f = sb->format ? sb->format[sb->format[0] == '=' || sb->format[0] == '<'
                                     || sb->format[0] == '@'] : 'B';
    int wide = (f == 'l' || f == 'q') && sb->itemsize == 8;
    if (sb->ndim != 1 || !(wide || (f == 'i' && sb->itemsize == 4))) {
        views_release(&v);
        PyErr_SetString(PyExc_TypeError, "slots: expected a 1-D int64 or int32 array");
        return NULL;
    }
    n = sb->shape[0];
    uint8_t *data = view(&v, args[2], 1, 0, &dn, &dw, "data");
    if (data == NULL) {
        views_release(&v);
        return NULL;
    }
    if (dn != n || (dw != w && !(n == 0))) {
        views_release(&v);
        PyErr_SetString(PyExc_TypeError, "data: expected one row of the pool's width per slot");
        return NULL;
    }
    long result = 1;
    const int64_t *s64 = sb->buf;
    const int32_t *s32 = sb->buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t s = wide ? s64[i] : (int64_t)s32[i];
        if (s < 0 || s >= p) {
            result = 0;
            break;
        }
    }
    if (result == 1 && n > 0) {
        uintptr_t a0 = (uintptr_t)array, a1 = a0 + (uintptr_t)(p * w);
        uintptr_t d0 = (uintptr_t)data, d1 = d0 + (uintptr_t)(n * w);
        if (d0 < a1 && a0 < d1)
            result = -1;
    }
    if (result == 1) {
        if (w == 1) {
            for (Py_ssize_t i = 0; i < n; i++)
                array[wide ? s64[i] : s32[i]] = data[i];
        } else {
            for (Py_ssize_t i = 0; i < n; i++)
                memcpy(array + (wide ? s64[i] : (int64_t)s32[i]) * w, data + i * w, (size_t)w);
        }
    }
    views_release(&v);
    return PyLong_FromLong(result);
}

static PyMethodDef methods[] = {
    {"write_rows", (PyCFunction)(void (*)(void))write_rows, METH_FASTCALL,
     "write_rows(array, slots, data) -> 1 written, 0 a slot out of range, -1 not handled."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_slots",
    "SlotPool.write's bounds check and row copy in C (see _slots.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__slots(void)
{
    return PyModule_Create(&module);
}
