/* Argument views for the coherence C helpers (kvtier.coherence._fast and
 * kvtier.coherence.policies._queues): each array argument is taken as a C-contiguous buffer of
 * a stated item size, and every view taken is released in one call, on success and on error. */
#ifndef KVTIER_CVIEWS_H
#define KVTIER_CVIEWS_H

#include <Python.h>

typedef struct {
    Py_buffer b[24];
    int n;
} Views;

static inline void views_release(Views *v)
{
    for (int i = 0; i < v->n; i++)
        PyBuffer_Release(&v->b[i]);
    v->n = 0;
}

/* The next argument as a C-contiguous array of itemsize-byte items; NULL (and an exception)
 * when it is not one. cols: its second dimension (1 for 1-D arrays) into *cols if not NULL. */
static inline void *view(Views *v, PyObject *obj, Py_ssize_t itemsize, int writable,
                         Py_ssize_t *len, Py_ssize_t *cols, const char *name)
{
    if (v->n >= (int)(sizeof v->b / sizeof v->b[0])) {
        PyErr_Format(PyExc_RuntimeError, "%s: too many array arguments", name);
        return NULL;
    }
    Py_buffer *b = &v->b[v->n];
    /* No PyBUF_FORMAT: only the item size is checked, and numpy builds (and then compares
     * with its cached one, and frees) a format string on every request that asks for it:
     * about a fifth of a view's cost, and the replay's put and get take ~60 views. */
    int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, b, flags) < 0)
        return NULL;
    v->n++;
    Py_ssize_t width = b->ndim == 2 ? b->shape[1] : 1;
    if (b->itemsize != itemsize || b->ndim < 1 || b->ndim > 2 || (cols == NULL && b->ndim != 1)) {
        PyErr_Format(PyExc_TypeError, "%s: expected a C-contiguous array of %zd-byte items",
                     name, itemsize);
        return NULL;
    }
    *len = b->shape[0];
    if (cols)
        *cols = width;
    return b->buf;
}

static inline int as_index(PyObject *obj, Py_ssize_t *out, const char *name)
{
    *out = PyLong_AsSsize_t(obj);
    if (*out == -1 && PyErr_Occurred())
        return -1;
    if (*out < 0) {
        PyErr_Format(PyExc_ValueError, "%s must not be negative", name);
        return -1;
    }
    return 0;
}

#endif
