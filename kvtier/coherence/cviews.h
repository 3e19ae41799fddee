/* Argument views for the coherence C helpers (kvtier.coherence._fast,
 * kvtier.coherence.policies._queues, kvtier.tiers._slots; the kept views also for
 * kvtier.pagetable._native): each array argument is taken as a C-contiguous buffer of
 * a stated item size, and every view taken is released in one call, on success and on error. */
#ifndef KVTIER_CVIEWS_H
#define KVTIER_CVIEWS_H

#include <Python.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    Py_buffer b[32];
    int n;
} Views;

/* Views kept between calls, of the long-lived arrays: the page table's columns, a pool's slot
 * arrays, a policy's state. numpy builds a fresh buffer description on every request (~700
 * instructions, ~55 views a replayed request: 7% of its instructions), for arrays that a
 * request passes again and again.
 *
 * Why a kept view cannot go stale: an entry holds a reference to its array and an export of
 * its buffer, so the array is neither freed (no other object can take its address while the
 * entry lives) nor resized (numpy refuses to resize an exported array); an ndarray's data,
 * shape and strides do not change otherwise. Only arrays that own their memory (base None)
 * and are at least VCACHE_MIN bytes are kept: a view of another array or of an mmap (a
 * pool's bytes) would hold its base's export open, and a request's small scratch arrays are
 * not worth it. Entries whose array nothing else references (a column replaced when the table
 * grew, an engine closed) are released at the next miss; the GIL serialises all of this. A
 * kept view was taken writable when the array allowed it; one taken read-only serves only
 * read-only requests. Arrays whose writeable flag is switched off later are not supported
 * (kvtier never does so to these arrays). */
#define VCACHE_N 64               /* a power of two */
#define VCACHE_WAYS 4
#define VCACHE_MIN 1024
typedef struct {
    PyObject *obj;                /* NULL: free; else the array (b.obj holds the reference) */
    int writable;
    Py_buffer b;
} KeptView;
static KeptView vcache[VCACHE_N];
static int vcache_next;

/* Where obj's entry may be: VCACHE_WAYS slots from its hash (an object's address). */
static inline int vcache_home(PyObject *obj)
{
    uintptr_t h = (uintptr_t)obj >> 4;
    return (int)((h ^ (h >> 7)) & (VCACHE_N - 1));
}

static inline const Py_buffer *vcache_find(PyObject *obj, int writable)
{
    int home = vcache_home(obj);
    for (int k = 0; k < VCACHE_WAYS; k++) {
        KeptView *e = &vcache[(home + k) & (VCACHE_N - 1)];
        if (e->obj == obj)
            return e->writable || !writable ? &e->b : NULL;
    }
    return NULL;
}

/* Keep *b (just taken, writable or not) when its array qualifies: moves the view into the
 * cache and returns the kept copy (the caller must not release *b), else NULL. */
static inline const Py_buffer *vcache_keep(PyObject *obj, Py_buffer *b, int writable)
{
    static PyObject *base_name;
    if (b->len < VCACHE_MIN || b->obj != obj
            || strcmp(Py_TYPE(obj)->tp_name, "numpy.ndarray") != 0)   /* not a subclass */
        return NULL;
    if (base_name == NULL && (base_name = PyUnicode_InternFromString("base")) == NULL) {
        PyErr_Clear();
        return NULL;
    }
    PyObject *base = PyObject_GetAttr(obj, base_name);
    if (base == NULL) {
        PyErr_Clear();
        return NULL;
    }
    int owns = base == Py_None;
    Py_DECREF(base);
    if (!owns)
        return NULL;
    for (int i = 0; i < VCACHE_N; i++)
        if (vcache[i].obj != NULL && Py_REFCNT(vcache[i].obj) == 1) {
            PyBuffer_Release(&vcache[i].b);      /* nothing else holds it: let it go */
            vcache[i].obj = NULL;
        }
    int home = vcache_home(obj), slot = -1;
    for (int k = 0; k < VCACHE_WAYS && slot < 0; k++) {
        KeptView *e = &vcache[(home + k) & (VCACHE_N - 1)];
        if (e->obj == NULL || e->obj == obj)     /* obj: kept read-only, now writable */
            slot = (home + k) & (VCACHE_N - 1);
    }
    if (slot < 0) {                              /* its ways hold live arrays: replace one */
        slot = (home + vcache_next) & (VCACHE_N - 1);
        vcache_next = (vcache_next + 1) % VCACHE_WAYS;
    }
    if (vcache[slot].obj != NULL)
        PyBuffer_Release(&vcache[slot].b);
    vcache[slot].obj = obj;
    vcache[slot].writable = writable;
    vcache[slot].b = *b;
    return &vcache[slot].b;
}

/* PyObject_GetBuffer(obj, b, C-contiguous, writable or not), served from or added to the kept
 * views; a kept one is copied with b->obj NULL, so that PyBuffer_Release(b) does nothing (for
 * code that releases its Py_buffers itself: kvtier.pagetable._native). */
static inline int get_kept_buffer(PyObject *obj, Py_buffer *b, int writable)
{
    const Py_buffer *k = vcache_find(obj, writable);
    if (k != NULL) {
        *b = *k;
        b->obj = NULL;
        return 0;
    }
    if (PyObject_GetBuffer(obj, b, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0)) < 0)
        return -1;
    if (vcache_keep(obj, b, writable) != NULL)
        b->obj = NULL;                           /* the kept entry holds the export */
    return 0;
}

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
    const Py_buffer *b = vcache_find(obj, writable);
    if (b == NULL) {
        Py_buffer *nb = &v->b[v->n];
        /* No PyBUF_FORMAT: only the item size is checked, and numpy builds (and then
         * compares with its cached one, and frees) a format string on every request that
         * asks for it: about a fifth of a view's cost. */
        int flags = PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0);
        if (PyObject_GetBuffer(obj, nb, flags) < 0)
            return NULL;
        b = vcache_keep(obj, nb, writable);
        if (b == NULL) {                         /* not kept: released with the others */
            v->n++;
            b = nb;
        }
    }
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
