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
 *   index_insert(index, rows, hashes)
 *       rows: n int64, hashes: n uint64 (their keys' hashes); each row is stored at the first
 *       EMPTY or tombstone position of its probe sequence. The caller keeps the load <= 1/2.
 *   index_remove(index, rows, hashes)
 *       each row's position (found along its probe sequence) becomes a tombstone (-2).
 *   link_rows(parent, first_child, next_sib, rows, parents)
 *       table.py's link: parents[i] (-1: none) becomes rows[i]'s parent; a row listed twice
 *       keeps its last parent; the new children of a parent go in front of its old list, in
 *       batch order; a row moving to another parent is detached first (O(siblings)).
 *   unlink_rows(parent, first_child, next_sib, rows)
 *       table.py's _unlink of each row: detached from its parent, its children orphaned.
 *   remove_rows(index, keycol, width, parent, first_child, next_sib, version, rows,
 *               free i64[m], nfree) -> (nfree', top)
 *       table.py's remove of each distinct row: its index entry becomes a tombstone (the
 *       hash computed from its key), it is unlinked as unlink_rows does, and it is pushed on
 *       the free-row stack free[nfree:]; returns the new stack height and the highest version
 *       among the rows (the table's version floor). Its columns are reset by reset_rows,
 *       in the same call when columns and fills follow (remove_rows(..., nfree, columns,
 *       fills): table.remove's two calls as one; nothing is reset when the removal fails).
 *   reset_rows(columns, fills, rows)
 *       columns: a tuple of C-contiguous arrays whose first dimension is the row; fills: a
 *       tuple of one row's bytes each; every listed row of every column is set to its fill.
 *   current_prefix(index, keycol, width, keys, version, copy_ver, local_mask, mem_mask)
 *       -> (n, below): Engine.lookup_prefix's local part in one pass (see the function).
 *   key_flags(keys, width) -> bits: 1 an all-zero key, 2 two keys of one hash.
 *   insert_keys(index, keycol, width, keys, free, nfree, n_rows, out_rows, out_created)
 *       -> (n_rows', nfree', created): table.py's insert in one pass (see the function).
 *   put_rows(index, columns, width, keys, parent_keys, free, nfree, n_rows, slot_row, pool,
 *            data, slots, xxh3, commit_next, tier, floor, base, clock, block_size,
 *            out_versions, out_rows) -> (n_rows', nfree', top) or None
 *       A host put of new keys in one call: insert, the pool's write and hash, the install,
 *       the chain (see the function).
 * These replace per-block Python loops and ~10 numpy calls each per batch (issue 18:
 * the replay spent most of its time there). None keeps a reference to its arguments;
 * hash_keys and lookup release the GIL over batches of 256 or more.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "keyhash.h"
#include "../coherence/cviews.h"     /* get_kept_buffer: the columns' views kept between calls */
#include "../coherence/install.h"    /* put_rows's install, install_rows's code */

#define EMPTY (-1)
#define NOGIL_BATCH 256

#define CORRUPT (-2)

/* The row of key along its probe sequence: -1 when absent, CORRUPT when the index names a
 * row past the key column (the index and the table disagree). */
static inline int64_t probe_key(const int32_t *index, uint64_t mask, const uint8_t *keycol,
                                Py_ssize_t rows, const uint8_t *key, Py_ssize_t width)
{
    uint64_t pos = hash_one(key, width) & mask;
    for (uint64_t probes = 0; probes <= mask; probes++) {
        int32_t r = index[pos];
        if (r == EMPTY)
            return -1;
        if (r >= 0) {
            if (r >= rows)
                return CORRUPT;
            if (memcmp(keycol + (Py_ssize_t)r * width, key, (size_t)width) == 0)
                return r;
        }
        pos = (pos + 1) & mask;
    }
    return -1;
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
        if (get_kept_buffer(args[i], &bufs[i], writable[i]) < 0) {
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

/* A tuple of count (2 or 3) new references, stolen: NULL when one is (its error) or the tuple
 * cannot be made, every reference dropped. Py_BuildValue parses its format on every call, ~1k
 * instructions of each of a replayed request's ~4 such returns. */
static PyObject *steal_tuple(Py_ssize_t count, PyObject *a, PyObject *b, PyObject *c)
{
    PyObject *items[3] = {a, b, c};
    PyObject *t = a && b && (c || count < 3) ? PyTuple_New(count) : NULL;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (t)
            PyTuple_SET_ITEM(t, i, items[i]);
        else
            Py_XDECREF(items[i]);
    }
    return t;
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
    /* An optional sixth argument, n_rows: rows past it were never handed out (the key
     * column's whole capacity can then be passed as it is, a kept view, not a slice). */
    Py_ssize_t n_rows = -1;
    if (nargs == 6) {
        n_rows = PyLong_AsSsize_t(args[5]);
        if (n_rows < 0) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "lookup: n_rows must not be negative");
            return NULL;
        }
        nargs = 5;
    }
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
    else if (n_rows > b[1].len / width)
        bad = "n_rows past the key column";
    if (bad) {
        release_buffers(b, 5, writable);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, bad);
        return NULL;
    }
    const int32_t *index = b[0].buf;
    const uint8_t *keycol = b[1].buf, *keys = b[3].buf;
    Py_ssize_t rows = n_rows >= 0 ? n_rows : b[1].len / width, n = b[3].len / width;
    int64_t *out = b[4].buf;
    uint64_t mask = (uint64_t)size - 1;
    int corrupt = 0;
    PyThreadState *ts = n >= NOGIL_BATCH ? PyEval_SaveThread() : NULL;
    for (Py_ssize_t i = 0; i < n && !corrupt; i++) {
        int64_t found = probe_key(index, mask, keycol, rows, keys + i * width, width);
        corrupt = found == CORRUPT;
        out[i] = found < 0 ? -1 : found;
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

#define TOMBSTONE (-2)

static int whole_items(Py_buffer *b, Py_ssize_t nbuf, const Py_ssize_t *itemsize,
                       const int *writable, const char *name)
{
    for (Py_ssize_t i = 0; i < nbuf; i++)
        if (itemsize[i] && b[i].len % itemsize[i]) {
            release_buffers(b, nbuf, writable);
            PyErr_Format(PyExc_ValueError, "%s: argument %zd is not a whole number of items",
                         name, i);
            return -1;
        }
    return 0;
}

/* index_insert and index_remove: (index int32, rows int64, hashes uint64). */
static int get_index_args(PyObject *const *args, Py_ssize_t nargs, const char *name,
                          Py_buffer *b)
{
    static const int writable[3] = {1, 0, 0};
    static const Py_ssize_t isz[3] = {4, 8, 8};
    if (get_buffers(args, nargs, name, 3, b, writable) < 0
            || whole_items(b, 3, isz, writable, name) < 0)
        return -1;
    Py_ssize_t size = b[0].len / 4;
    if (size == 0 || (size & (size - 1)) || b[1].len != b[2].len) {
        release_buffers(b, 3, writable);
        PyErr_Format(PyExc_ValueError, "%s: an index of power-of-two size and one hash per row",
                     name);
        return -1;
    }
    return 0;
}

static PyObject *index_insert(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const int writable[3] = {1, 0, 0};
    Py_buffer b[3];
    if (get_index_args(args, nargs, "index_insert", b) < 0)
        return NULL;
    int32_t *index = b[0].buf;
    const int64_t *rows = b[1].buf;
    const uint64_t *h = b[2].buf;
    Py_ssize_t size = b[0].len / 4, n = b[1].len / 8;
    uint64_t mask = (uint64_t)size - 1;
    int full = 0;
    for (Py_ssize_t i = 0; i < n && !full; i++) {
        uint64_t pos = h[i] & mask;
        Py_ssize_t probes = 0;
        while (index[pos] >= 0 && ++probes < size)
            pos = (pos + 1) & mask;
        if (index[pos] >= 0)
            full = 1;
        else
            index[pos] = (int32_t)rows[i];
    }
    release_buffers(b, 3, writable);
    if (full) {
        PyErr_SetString(PyExc_RuntimeError, "page-table index is full");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *index_remove(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const int writable[3] = {1, 0, 0};
    Py_buffer b[3];
    if (get_index_args(args, nargs, "index_remove", b) < 0)
        return NULL;
    int32_t *index = b[0].buf;
    const int64_t *rows = b[1].buf;
    const uint64_t *h = b[2].buf;
    Py_ssize_t size = b[0].len / 4, n = b[1].len / 8;
    uint64_t mask = (uint64_t)size - 1;
    int missing = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t pos = h[i] & mask;
        Py_ssize_t probes = 0;
        while (index[pos] != (int32_t)rows[i] && index[pos] != EMPTY && ++probes < size)
            pos = (pos + 1) & mask;
        if (index[pos] == (int32_t)rows[i])
            index[pos] = TOMBSTONE;
        else
            missing = 1;
    }
    release_buffers(b, 3, writable);
    if (missing) {
        PyErr_SetString(PyExc_RuntimeError, "index_remove: a row is not in the index");
        return NULL;
    }
    Py_RETURN_NONE;
}

static void detach(int32_t *parent, int32_t *first, int32_t *nxt, int64_t row)
{
    int32_t par = parent[row];
    if (first[par] == row) {
        first[par] = nxt[row];
    } else {
        int32_t cur = first[par];
        while (cur >= 0 && nxt[cur] != row)
            cur = nxt[cur];
        if (cur >= 0)
            nxt[cur] = nxt[row];
    }
    nxt[row] = -1;
    parent[row] = -1;
}

/* A row detached from its parent, its children orphaned (table.py's _unlink). */
static void unlink_one(int32_t *parent, int32_t *first, int32_t *nxt, int64_t row)
{
    if (parent[row] >= 0)
        detach(parent, first, nxt, row);
    int32_t child = first[row];
    while (child >= 0) {
        int32_t following = nxt[child];
        parent[child] = -1;
        nxt[child] = -1;
        child = following;
    }
    first[row] = -1;
}

/* link_rows and unlink_rows: parent, first_child, next_sib (int32 columns), then int64 rows
 * (and parents), every value checked to be a row of the columns. */
static int get_link_args(PyObject *const *args, Py_ssize_t nargs, const char *name,
                         Py_ssize_t want, Py_buffer *b, const int *writable)
{
    static const Py_ssize_t isz[5] = {4, 4, 4, 8, 8};
    if (get_buffers(args, nargs, name, want, b, writable) < 0
            || whole_items(b, want, isz, writable, name) < 0)
        return -1;
    Py_ssize_t rows = b[0].len / 4, n = b[3].len / 8;
    const int64_t *r = b[3].buf, *p = want == 5 ? b[4].buf : NULL;
    int bad = b[1].len != b[0].len || b[2].len != b[0].len || (p && b[4].len != b[3].len);
    for (Py_ssize_t i = 0; i < n && !bad; i++)
        bad = r[i] < 0 || r[i] >= rows || (p && (p[i] < -1 || p[i] >= rows));
    if (bad) {
        release_buffers(b, want, writable);
        PyErr_Format(PyExc_ValueError, "%s: columns of one length, rows and parents inside "
                     "them, one parent per row", name);
        return -1;
    }
    return 0;
}

/* Each row linked under its parent (-1: none), table.py's link: backwards, each new child put
 * in front of its parent's list, so that the new children end up in batch order ahead of the
 * old ones, and a row's last occurrence, met first, is the one that counts (a small
 * open-addressing set of the rows done). Every row and parent was checked by the caller.
 * -1 (and MemoryError) when the set cannot be had, nothing linked. */
static int link_each(int32_t *parent, int32_t *first, int32_t *nxt, const int64_t *rows,
                     const int64_t *parents, Py_ssize_t n)
{
    Py_ssize_t cap = 16;
    while (cap < 2 * n)
        cap *= 2;
    int64_t *done = PyMem_Malloc((size_t)cap * sizeof(int64_t));
    if (!done) {
        PyErr_NoMemory();
        return -1;
    }
    memset(done, 0xff, (size_t)cap * sizeof(int64_t));
    for (Py_ssize_t i = n - 1; i >= 0; i--) {
        int64_t row = rows[i], p = parents[i];
        uint64_t at = ((uint64_t)row * MIX1) & (uint64_t)(cap - 1);
        while (done[at] >= 0 && done[at] != row)
            at = (at + 1) & (uint64_t)(cap - 1);
        if (done[at] == row)
            continue;
        done[at] = row;
        if (parent[row] == p || row == p)
            continue;
        if (parent[row] >= 0)
            detach(parent, first, nxt, row);
        if (p >= 0) {
            nxt[row] = first[p];
            first[p] = (int32_t)row;
            parent[row] = (int32_t)p;
        }
    }
    PyMem_Free(done);
    return 0;
}

static PyObject *link_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const int writable[5] = {1, 1, 1, 0, 0};
    Py_buffer b[5];
    if (get_link_args(args, nargs, "link_rows", 5, b, writable) < 0)
        return NULL;
    int r = link_each(b[0].buf, b[1].buf, b[2].buf, b[3].buf, b[4].buf, b[3].len / 8);
    release_buffers(b, 5, writable);
    if (r < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* link_keys(index, keycol, width, parent_keys, parent, first_child, next_sib, rows, n_rows):
 * table.py's link_keys in one call: each parent key looked up (a key not in the table is no
 * parent: its row is unlinked), then link_rows. A commit's chain, once per replayed request:
 * the lookup's output array, its call and the link's call were ~3k instructions of glue.
 * Everything is checked before anything is linked. */
static PyObject *link_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const int writable[9] = {0, 0, -1, 0, 1, 1, 1, 0, -1};
    static const Py_ssize_t isz[9] = {4, 1, 0, 1, 4, 4, 4, 8, 0};
    Py_buffer b[9];
    if (get_buffers(args, nargs, "link_keys", 9, b, writable) < 0
            || whole_items(b, 9, isz, writable, "link_keys") < 0)
        return NULL;
    Py_ssize_t width = PyLong_AsSsize_t(args[2]);
    Py_ssize_t n_rows = PyErr_Occurred() ? -1 : PyLong_AsSsize_t(args[8]);
    Py_ssize_t size = b[0].len / 4, nrows = b[4].len / 4, n = b[7].len / 8;
    const int64_t *rows = b[7].buf;
    const char *bad = NULL;
    if (width <= 0 || n_rows < 0 || PyErr_Occurred())
        bad = "width and n_rows must be positive";
    else if (size == 0 || (size & (size - 1)))
        bad = "an index of power-of-two size";
    else if (b[1].len % width || b[3].len != n * width || n_rows > b[1].len / width)
        bad = "keycol whole keys, and one parent key per row";
    else if (b[5].len != b[4].len || b[6].len != b[4].len)
        bad = "link columns of one length";
    for (Py_ssize_t i = 0; i < n && !bad; i++)
        if (rows[i] < 0 || rows[i] >= nrows)
            bad = "a row outside the columns";
    int64_t *parents = NULL;
    if (!bad && (parents = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int64_t))) == NULL) {
        release_buffers(b, 9, writable);
        return PyErr_NoMemory();
    }
    Py_ssize_t keyrows = n_rows;          /* rows past n_rows were never handed out */
    uint64_t mask = (uint64_t)size - 1;
    for (Py_ssize_t i = 0; i < n && !bad; i++) {
        int64_t found = probe_key(b[0].buf, mask, b[1].buf, keyrows,
                                  (const uint8_t *)b[3].buf + i * width, width);
        if (found == CORRUPT)
            bad = "the index names a row past the key column";
        else if (found >= nrows)
            bad = "a parent row outside the link columns";
        parents[i] = found < 0 ? -1 : found;
    }
    int r = bad ? -1 : link_each(b[4].buf, b[5].buf, b[6].buf, rows, parents, n);
    PyMem_Free(parents);
    release_buffers(b, 9, writable);
    if (bad) {
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "link_keys: %s", bad);
        return NULL;
    }
    if (r < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *unlink_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const int writable[4] = {1, 1, 1, 0};
    Py_buffer b[4];
    if (get_link_args(args, nargs, "unlink_rows", 4, b, writable) < 0)
        return NULL;
    int32_t *parent = b[0].buf, *first = b[1].buf, *nxt = b[2].buf;
    const int64_t *rows = b[3].buf;
    Py_ssize_t n = b[3].len / 8;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t row = rows[i];
        unlink_one(parent, first, nxt, row);
    }
    release_buffers(b, 4, writable);
    Py_RETURN_NONE;
}

/* A small open-addressing set of rows, for the functions that take each row once. */
typedef struct {
    int64_t *slot;
    uint64_t mask;
} RowSet;

static int rowset_init(RowSet *s, Py_ssize_t n)
{
    Py_ssize_t cap = 16;
    while (cap < 2 * n)
        cap *= 2;
    s->slot = PyMem_Malloc((size_t)cap * sizeof(int64_t));
    if (!s->slot) {
        PyErr_NoMemory();
        return -1;
    }
    memset(s->slot, 0xff, (size_t)cap * sizeof(int64_t));
    s->mask = (uint64_t)cap - 1;
    return 0;
}

/* 1 when row was added, 0 when it was there already. */
static int rowset_add(RowSet *s, int64_t row)
{
    uint64_t at = ((uint64_t)row * MIX1) & s->mask;
    while (s->slot[at] >= 0 && s->slot[at] != row)
        at = (at + 1) & s->mask;
    if (s->slot[at] == row)
        return 0;
    s->slot[at] = row;
    return 1;
}

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static int reset_core(PyObject *columns, PyObject *fills, const int64_t *rows, Py_ssize_t n);

static PyObject *remove_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const int writable[10] = {1, 0, -1, 1, 1, 1, 0, 0, 1, -1};
    static const Py_ssize_t isz[10] = {4, 1, 0, 4, 4, 4, 8, 8, 8, 0};
    Py_buffer b[10];
    int reset = nargs == 12;           /* columns and fills follow: reset the rows too */
    if (get_buffers(args, reset ? 10 : nargs, "remove_rows", 10, b, writable) < 0
            || whole_items(b, 10, isz, writable, "remove_rows") < 0)
        return NULL;
    Py_ssize_t width = PyLong_AsSsize_t(args[2]);
    Py_ssize_t nfree = PyLong_AsSsize_t(args[9]);
    int32_t *index = b[0].buf, *parent = b[3].buf, *first = b[4].buf, *nxt = b[5].buf;
    const uint8_t *keycol = b[1].buf;
    const uint64_t *version = b[6].buf;
    const int64_t *rows = b[7].buf;
    int64_t *freelist = b[8].buf;
    Py_ssize_t size = b[0].len / 4, nrows = b[3].len / 4, n = b[7].len / 8;
    const char *bad = NULL;
    if (width <= 0 || nfree < 0 || PyErr_Occurred())
        bad = "width and the free count must be positive";
    else if (size == 0 || (size & (size - 1)))
        bad = "an index of power-of-two size";
    else if (b[4].len != b[3].len || b[5].len != b[3].len || b[6].len / 8 < nrows
             || b[1].len / width < nrows)
        bad = "columns shorter than the rows";
    else if (nfree + n > b[8].len / 8)
        bad = "the free list has no room for the rows";
    for (Py_ssize_t i = 0; i < n && !bad; i++)
        if (rows[i] < 0 || rows[i] >= nrows)
            bad = "a row outside the columns";
    if (bad) {
        release_buffers(b, 10, writable);
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "remove_rows: %s", bad);
        return NULL;
    }
    RowSet seen;
    if (rowset_init(&seen, n) < 0) {
        release_buffers(b, 10, writable);
        return NULL;
    }
    uint64_t mask = (uint64_t)size - 1, top = 0;
    Py_ssize_t k = nfree;
    int missing = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t row = rows[i];
        if (!rowset_add(&seen, row))
            continue;
        uint64_t pos = hash_one(keycol + row * width, width) & mask;
        Py_ssize_t probes = 0;
        while (index[pos] != (int32_t)row && index[pos] != EMPTY && ++probes < size)
            pos = (pos + 1) & mask;
        if (index[pos] != (int32_t)row) {
            missing = 1;
            break;
        }
        index[pos] = TOMBSTONE;
        unlink_one(parent, first, nxt, row);
        if (version[row] > top)
            top = version[row];
        freelist[k++] = row;
    }
    PyMem_Free(seen.slot);
    /* Ascending on the stack, as table.py's numpy remove (np.unique) leaves them. The rows are
     * distinct: a large batch is sorted through a bitmap of the table's rows (one pass over
     * nrows / 64 words), a small one by qsort. */
    Py_ssize_t got = k - nfree;
    uint64_t *bits = NULL;
    if (got > 64 && nrows / 64 <= 8 * got)
        bits = PyMem_Calloc((size_t)(nrows / 64 + 1), sizeof(uint64_t));
    if (bits) {
        for (Py_ssize_t i = nfree; i < k; i++)
            bits[freelist[i] >> 6] |= (uint64_t)1 << (freelist[i] & 63);
        Py_ssize_t out = nfree;
        for (Py_ssize_t w = 0; w <= nrows / 64; w++)
            for (uint64_t word = bits[w]; word; word &= word - 1)
                freelist[out++] = (int64_t)w * 64 + __builtin_ctzll(word);
        PyMem_Free(bits);
    } else if (got <= 64) {
        /* A replayed request's ~25 rows: an insertion sort (glibc's qsort is a merge sort
         * through a comparison callback and a scratch buffer, ~6k instructions for 25). */
        int64_t *a = freelist + nfree;
        for (Py_ssize_t i = 1; i < got; i++) {
            int64_t x = a[i];
            Py_ssize_t j = i;
            for (; j > 0 && a[j - 1] > x; j--)
                a[j] = a[j - 1];
            a[j] = x;
        }
    } else {
        qsort(freelist + nfree, (size_t)got, sizeof(int64_t), cmp_i64);
    }
    /* The reset reads the rows through this call's own view of them (no second request). */
    int failed = !missing && reset && reset_core(args[10], args[11], rows, n) < 0;
    release_buffers(b, 10, writable);
    if (missing) {
        PyErr_SetString(PyExc_RuntimeError, "remove_rows: a row is not in the index");
        return NULL;
    }
    if (failed)
        return NULL;
    return steal_tuple(2, PyLong_FromSsize_t(k),
                       PyLong_FromUnsignedLongLong((unsigned long long)top), NULL);
}

/* reset_rows(columns, fills, rows): each column's row set to its fill (one row's bytes).
 * The rows are checked once against the shortest column, and a fill that is a bytes object
 * (the table's own, PageTable._row_fills) is read in place: a replayed request's eviction
 * resets ~25 rows of 16 columns, and a buffer request per fill and a bounds pass per column
 * were most of the call's ~12k instructions. Nothing is written when a check fails.
 * reset_core is its work on rows already taken (remove_rows's own view of them): 0, or -1
 * with an exception. */
#define RESET_MAX_COLS 32
static int reset_core(PyObject *columns, PyObject *fills, const int64_t *rows, Py_ssize_t n)
{
    if (!PyTuple_Check(columns) || !PyTuple_Check(fills)
            || PyTuple_GET_SIZE(columns) != PyTuple_GET_SIZE(fills)
            || PyTuple_GET_SIZE(columns) > RESET_MAX_COLS) {
        PyErr_SetString(PyExc_TypeError, "reset_rows(columns tuple, fills tuple, rows), at "
                        "most 32 columns");
        return -1;
    }
    Py_ssize_t ncols = PyTuple_GET_SIZE(columns);
    Py_buffer cb[RESET_MAX_COLS], fb[RESET_MAX_COLS];
    int fb_taken[RESET_MAX_COLS];
    const char *fill[RESET_MAX_COLS];
    Py_ssize_t width[RESET_MAX_COLS];
    Py_ssize_t got = 0, cap = PY_SSIZE_T_MAX;
    int ok = 1;
    for (; got < ncols; got++) {
        PyObject *f = PyTuple_GET_ITEM(fills, got);
        if (get_kept_buffer(PyTuple_GET_ITEM(columns, got), &cb[got], 1) < 0)
            break;
        if (PyBytes_CheckExact(f)) {
            fb_taken[got] = 0;
            fill[got] = PyBytes_AS_STRING(f);
            width[got] = PyBytes_GET_SIZE(f);
        } else if (PyObject_GetBuffer(f, &fb[got], PyBUF_C_CONTIGUOUS) < 0) {
            PyBuffer_Release(&cb[got]);
            break;
        } else {
            fb_taken[got] = 1;
            fill[got] = fb[got].buf;
            width[got] = fb[got].len;
        }
        Py_ssize_t c = cb[got].ndim >= 1 ? cb[got].shape[0] : 0;
        if (c <= 0 || width[got] <= 0 || cb[got].len != c * width[got])
            ok = 0;
        if (c < cap)
            cap = c;
    }
    for (Py_ssize_t i = 0; i < n && ok && got == ncols; i++)
        ok = rows[i] >= 0 && rows[i] < cap;
    if (ok && got == ncols) {
        for (Py_ssize_t c = 0; c < ncols; c++) {
            uint8_t *base = cb[c].buf;
            const char *fc = fill[c];
            /* The common widths as fixed-size copies (the compiler makes each one store):
             * 16 columns of 4,096 rows were 65,536 calls of memcpy. */
#define RESET_WIDTH(w)                                                          \
            case w:                                                             \
                for (Py_ssize_t i = 0; i < n; i++)                              \
                    memcpy(base + rows[i] * (w), fc, (w));                      \
                break;
            switch (width[c]) {
                RESET_WIDTH(1)
                RESET_WIDTH(2)
                RESET_WIDTH(4)
                RESET_WIDTH(8)
                RESET_WIDTH(16)
                RESET_WIDTH(12)
                RESET_WIDTH(32)
            default:
                for (Py_ssize_t i = 0; i < n; i++)
                    memcpy(base + rows[i] * width[c], fc, (size_t)width[c]);
            }
#undef RESET_WIDTH
        }
    }
    for (Py_ssize_t c = 0; c < got; c++) {
        if (fb_taken[c])
            PyBuffer_Release(&fb[c]);
        PyBuffer_Release(&cb[c]);
    }
    if (got < ncols)
        return -1;                     /* a column or fill refused its buffer: its error */
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "reset_rows: a fill is not one row of its "
                        "column, or a row is outside it");
        return -1;
    }
    return 0;
}

static PyObject *reset_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "reset_rows(columns tuple, fills tuple, rows), at "
                        "most 32 columns");
        return NULL;
    }
    Py_buffer rb;
    if (PyObject_GetBuffer(args[2], &rb, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    int done = reset_core(args[0], args[1], rb.buf, rb.len / 8);
    PyBuffer_Release(&rb);
    if (done < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* current_prefix(index, keycol, width, keys, version, copy_ver, local_mask, mem_mask)
 *     -> (n, below): how many leading keys have a row whose version > 0 is held by a copy in
 *     one of the tiers of local_mask (bit t: copy_ver column t), and how many of those n have
 *     no such copy in the tiers of mem_mask. */
static PyObject *current_prefix(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const int writable[8] = {0, 0, -1, 0, 0, 0, -1, -1};
    Py_buffer b[8];
    if (get_buffers(args, nargs, "current_prefix", 8, b, writable) < 0)
        return NULL;
    Py_ssize_t width = PyLong_AsSsize_t(args[2]);
    long local = PyLong_AsLong(args[6]), mem = PyLong_AsLong(args[7]);
    Py_ssize_t size = b[0].len / 4, nrows = width > 0 ? b[1].len / width : 0;
    Py_ssize_t ntiers = b[5].ndim == 2 ? b[5].shape[1] : 0;
    if (PyErr_Occurred() || width <= 0 || b[3].len % width || size == 0 || (size & (size - 1))
            || b[4].len / 8 < nrows || b[5].itemsize != 8 || ntiers <= 0
            || b[5].shape[0] < nrows || ntiers > 16) {
        release_buffers(b, 8, writable);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "current_prefix: see _native.c for the arrays");
        return NULL;
    }
    const int32_t *index = b[0].buf;
    const uint8_t *keycol = b[1].buf, *keys = b[3].buf;
    const uint64_t *version = b[4].buf, *copy_ver = b[5].buf;
    Py_ssize_t n = b[3].len / width, done = 0, below = 0;
    uint64_t mask = (uint64_t)size - 1;
    for (; done < n; done++) {
        int64_t row = probe_key(index, mask, keycol, nrows, keys + done * width, width);
        if (row < 0 || version[row] == 0)
            break;
        int cur = 0, in_mem = 0;
        for (Py_ssize_t t = 0; t < ntiers; t++)
            if (copy_ver[row * ntiers + t] == version[row]) {
                cur |= (local >> t) & 1;
                in_mem |= (mem >> t) & 1;
            }
        if (!cur)
            break;
        below += !in_mem;
    }
    release_buffers(b, 8, writable);
    return steal_tuple(2, PyLong_FromSsize_t(done), PyLong_FromSsize_t(below), NULL);
}

/* insert_keys(index, keycol, width, keys, free, nfree, n_rows, out_rows, out_created)
 *     -> (n_rows', nfree', created): table.py's insert in one pass. Each key found along its
 *     probe sequence gets its row; a missing one takes the top of the free-row stack (else
 *     row n_rows, which grows), its key is written and its row stored at the first free or
 *     tombstone position of its probe sequence, so that a repeat later in the batch finds it
 *     (one row per distinct key, created marked at its first occurrence). The caller has made
 *     room: the key column holds n_rows + len(keys) rows, the index stays at most half full,
 *     and the rows past n_rows are already reset. */
static PyObject *insert_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const int writable[9] = {1, 1, -1, 0, 0, -1, -1, 1, 1};
    static const Py_ssize_t isz[9] = {4, 1, 0, 1, 8, 0, 0, 8, 1};
    Py_buffer b[9];
    if (get_buffers(args, nargs, "insert_keys", 9, b, writable) < 0
            || whole_items(b, 9, isz, writable, "insert_keys") < 0)
        return NULL;
    Py_ssize_t width = PyLong_AsSsize_t(args[2]);
    Py_ssize_t nfree = PyErr_Occurred() ? -1 : PyLong_AsSsize_t(args[5]);
    Py_ssize_t n_rows = PyErr_Occurred() ? -1 : PyLong_AsSsize_t(args[6]);
    Py_ssize_t size = b[0].len / 4, n = width > 0 ? b[3].len / width : 0;
    Py_ssize_t cap = width > 0 ? b[1].len / width : 0;
    const char *bad = NULL;
    if (PyErr_Occurred() || width <= 0 || nfree < 0 || n_rows < 0 || b[3].len % width)
        bad = "width, nfree and n_rows must be positive; keys whole keys of width";
    else if (size == 0 || (size & (size - 1)))
        bad = "an index of power-of-two size";
    else if (n_rows + n > cap || nfree > b[4].len / 8 || b[7].len / 8 < n || b[8].len < n)
        bad = "no room made for the batch, or outputs shorter than the keys";
    /* Only the top n of the free stack can be handed out: check those, not the whole stack
     * (O(batch), not O(rows ever freed)), before anything is written. */
    for (Py_ssize_t i = nfree > n ? nfree - n : 0; i < nfree && !bad; i++)
        if (((int64_t *)b[4].buf)[i] < 0 || ((int64_t *)b[4].buf)[i] >= n_rows)
            bad = "a free row outside the table";
    if (bad) {
        release_buffers(b, 9, writable);
        if (!PyErr_Occurred())
            PyErr_Format(PyExc_ValueError, "insert_keys: %s", bad);
        return NULL;
    }
    int32_t *index = b[0].buf;
    uint8_t *keycol = b[1].buf;
    const uint8_t *keys = b[3].buf;
    const int64_t *freelist = b[4].buf;
    int64_t *out = b[7].buf;
    uint8_t *created = b[8].buf;
    uint64_t mask = (uint64_t)size - 1;
    Py_ssize_t made = 0;
    int corrupt = 0;
    for (Py_ssize_t i = 0; i < n && !corrupt; i++) {
        const uint8_t *key = keys + i * width;
        uint64_t pos = hash_one(key, width) & mask, spot = UINT64_MAX;
        int64_t row = -1;
        for (uint64_t probes = 0; probes <= mask; probes++) {
            int32_t r = index[pos];
            if (r == EMPTY) {
                if (spot == UINT64_MAX)
                    spot = pos;
                break;
            }
            if (r == TOMBSTONE) {
                if (spot == UINT64_MAX)
                    spot = pos;
            } else if (r >= n_rows) {
                corrupt = 1;
                break;
            } else if (memcmp(keycol + (Py_ssize_t)r * width, key, (size_t)width) == 0) {
                row = r;
                break;
            }
            pos = (pos + 1) & mask;
        }
        created[i] = 0;
        if (row < 0 && !corrupt) {
            if (spot == UINT64_MAX) {
                corrupt = 1;                       /* a full index: the caller made no room */
                break;
            }
            row = nfree > 0 ? freelist[--nfree] : n_rows++;
            memcpy(keycol + row * width, key, (size_t)width);
            index[spot] = (int32_t)row;
            created[i] = 1;
            made++;
        }
        out[i] = row;
    }
    release_buffers(b, 9, writable);
    if (corrupt) {
        PyErr_SetString(PyExc_RuntimeError, "insert_keys: the index and the table disagree, "
                        "or the index is full");
        return NULL;
    }
    return steal_tuple(3, PyLong_FromSsize_t(n_rows), PyLong_FromSsize_t(nfree),
                       PyLong_FromSsize_t(made));
}

/* key_flags(keys, width) -> bits: 1 when some key is all zeros (reserved: it means "no
 * parent"), 2 when two keys share a hash (a repeat, or a collision: the caller's exact path
 * settles which). One pass over a batch, a small open-addressing set of the hashes. */
#define KEY_SET_HERE 128
static PyObject *key_flags(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    static const int writable[2] = {0, -1};
    Py_buffer b[2];
    if (get_buffers(args, nargs, "key_flags", 2, b, writable) < 0)
        return NULL;
    Py_ssize_t width = PyLong_AsSsize_t(args[1]);
    if (width <= 0 || PyErr_Occurred() || b[0].len % width) {
        release_buffers(b, 2, writable);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "key_flags: whole keys of a positive width");
        return NULL;
    }
    Py_ssize_t n = b[0].len / width, cap = 16;
    while (cap < 2 * n)
        cap *= 2;
    /* A put's batch of up to 64 keys (the replay's ~25) hashes into sets on the stack. */
    uint64_t set_here[KEY_SET_HERE];
    uint8_t used_here[KEY_SET_HERE];
    int here = cap <= KEY_SET_HERE;
    uint64_t *set = here ? set_here : PyMem_Calloc((size_t)cap, sizeof(uint64_t));
    uint8_t *used = here ? used_here : PyMem_Calloc((size_t)cap, 1);
    if (!set || !used) {
        PyMem_Free(set);
        PyMem_Free(used);
        release_buffers(b, 2, writable);
        return PyErr_NoMemory();
    }
    if (here)
        memset(used, 0, (size_t)cap);
    const uint8_t *keys = b[0].buf;
    long flags = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const uint8_t *key = keys + i * width;
        /* All zeros: 8 bytes at a time (a replayed key's first 8 bytes are zero). */
        Py_ssize_t j = 0;
        uint64_t word = 0;
        for (; j + 8 <= width && word == 0; j += 8)
            memcpy(&word, key + j, 8);
        while (j < width && word == 0)
            word = key[j++];
        if (word == 0)
            flags |= 1;
        uint64_t h = hash_one(key, width), at = h & (uint64_t)(cap - 1);
        while (used[at] && set[at] != h)
            at = (at + 1) & (uint64_t)(cap - 1);
        if (used[at])
            flags |= 2;
        used[at] = 1;
        set[at] = h;
    }
    if (!here) {
        PyMem_Free(set);
        PyMem_Free(used);
    }
    release_buffers(b, 2, writable);
    return PyLong_FromLong(flags);
}

/* put_rows(index, columns, width, keys, parent_keys, free, nfree, n_rows, slot_row, pool,
 *          data, slots, xxh3, commit_next, tier, floor, base, clock, block_size,
 *          out_versions, out_rows) -> (n_rows', nfree', top) or None
 *     A host put of keys none of which has a row, in one call (issue 18: the replay's put
 *     was ~16 Python frames and ~10 C calls around work of a few microseconds): each key
 *     takes the next row insert_keys would give it (the free stack's top, else n_rows), its
 *     data row is copied into its slot of the pool and hashed there (xxh3: the address of
 *     libxxhash's XXH3_64bits, as kvtier.checksums loads it), the row is installed as
 *     kvtier.coherence._fast.install_rows installs it (install.h, the same code), and then
 *     each row is linked under its parent key's row (link_keys; parents may be keys of this
 *     batch). columns: the table's (key, version, leases, size, checksum, state,
 *     last_access, prev_access, freq, slot, copy_ver, parent, first_child, next_sib), as
 *     PageTable keeps them in _put_cols. The rows past n_rows it may take are reset by the
 *     caller first, and the index has room (at most half full after the batch:
 *     checked, with the live rows n_rows - nfree).
 *     None, with nothing written, when some key has a row already, two keys share a hash,
 *     data overlaps the pool, or keys, parent keys or data are not C-contiguous: the caller
 *     takes the general path. Every argument, row,
 *     slot (in range, given once, not holding a row's copy) and state move is checked before
 *     anything is written (ValueError, TypeError);
 *     RuntimeError when the index and the table disagree. */
#define PUT_COLS 14
typedef uint64_t (*xxh3_fn)(const void *, size_t);

static PyObject *put_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 21 || !PyTuple_Check(args[1]) || PyTuple_GET_SIZE(args[1]) != PUT_COLS) {
        PyErr_SetString(PyExc_TypeError, "put_rows takes 21 arguments, the columns a tuple of "
                        "14 arrays");
        return NULL;
    }
    Py_ssize_t width = PyLong_AsSsize_t(args[2]);
    if (width <= 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "put_rows: width must be positive");
        return NULL;
    }
    static const Py_ssize_t col_item[PUT_COLS] = {0, 8, 2, 4, 8, 1, 8, 8, 4, 4, 8, 4, 4, 4};
    static const char *col_name[PUT_COLS] = {"key", "version", "leases", "size", "checksum",
        "state", "last_access", "prev_access", "freq", "slot", "copy_ver", "parent",
        "first_child", "next_sib"};
    Views v = {.n = 0};
    uint64_t *h = NULL;                            /* the scratch, past the argument checks */
    void *col[PUT_COLS];
    Py_ssize_t clen[PUT_COLS], nsl = 1, nt = 1, isz, n, pn, nfl, nsr, p, pw, dn, dw, ns_, nnext;
    Py_ssize_t nov, nor;
    int32_t *index = view(&v, args[0], 4, 1, &isz, NULL, "index");
    if (index == NULL)
        goto fail;
    for (int c = 0; c < PUT_COLS; c++) {
        Py_ssize_t *cols = c == 9 ? &nsl : c == 10 ? &nt : NULL;
        col[c] = view(&v, PyTuple_GET_ITEM(args[1], c), col_item[c] ? col_item[c] : width, 1,
                      &clen[c], cols, col_name[c]);
        if (col[c] == NULL)
            goto fail;
    }
    /* The caller's keys, parent keys and data may be strided views: the general path
     * copies those, so a buffer they refuse means None, not an error. */
    const uint8_t *keys = view(&v, args[3], width, 0, &n, NULL, "keys");
    const uint8_t *pkeys = keys ? view(&v, args[4], width, 0, &pn, NULL, "parent_keys") : NULL;
    const uint8_t *data = pkeys ? view(&v, args[10], 1, 0, &dn, &dw, "data") : NULL;
    if (data == NULL && (PyErr_ExceptionMatches(PyExc_ValueError)
                         || PyErr_ExceptionMatches(PyExc_BufferError))) {
        PyErr_Clear();
        views_release(&v);
        Py_RETURN_NONE;
    }
    const int64_t *freel = data ? view(&v, args[5], 8, 0, &nfl, NULL, "free") : NULL;
    int64_t *slot_row = freel ? view(&v, args[8], 8, 1, &nsr, NULL, "slot_row") : NULL;
    uint8_t *pool = slot_row ? view(&v, args[9], 1, 1, &p, &pw, "pool") : NULL;
    const int64_t *slots = pool ? view(&v, args[11], 8, 0, &ns_, NULL, "slots") : NULL;
    const uint8_t *next = slots ? view(&v, args[13], 1, 0, &nnext, NULL, "commit_next") : NULL;
    uint64_t *outv = next ? view(&v, args[19], 8, 1, &nov, NULL, "out_versions") : NULL;
    int64_t *outr = outv ? view(&v, args[20], 8, 1, &nor, NULL, "out_rows") : NULL;
    if (outr == NULL)
        goto fail;
    Py_ssize_t nfree, n_rows, tier;
    if (as_index(args[6], &nfree, "nfree") < 0 || as_index(args[7], &n_rows, "n_rows") < 0
            || as_index(args[14], &tier, "tier") < 0)
        goto fail;
    void *fnp = PyLong_AsVoidPtr(args[12]);
    unsigned long long floor_ = PyErr_Occurred() ? 0 : PyLong_AsUnsignedLongLong(args[15]);
    unsigned long long base = PyErr_Occurred() ? 0 : PyLong_AsUnsignedLongLong(args[16]);
    unsigned long long clock = PyErr_Occurred() ? 0 : PyLong_AsUnsignedLongLong(args[17]);
    unsigned long long bb = PyErr_Occurred() ? 0 : PyLong_AsUnsignedLongLong(args[18]);
    if (PyErr_Occurred())
        goto fail;
    Py_ssize_t cap = clen[0];
    const char *bad = NULL;
    for (int c = 1; c < PUT_COLS && !bad; c++)
        if (clen[c] != cap)
            bad = "columns of different lengths";
    if (bad)
        ;
    else if (fnp == NULL || bb > UINT32_MAX)
        bad = "a null hash function or a block size past 32 bits";
    else if (isz == 0 || (isz & (isz - 1)))
        bad = "an index of power-of-two size";
    else if (pn != n || dn != n || ns_ != n || nov < n || nor < n || (n && dw != pw))
        bad = "one parent key, data row, slot and output per key, data rows of the pool's width";
    else if (tier >= nsl || tier >= nt || nfree > nfl || n_rows > cap)
        bad = "a tier inside the columns, nfree inside the free stack, n_rows inside the columns";
    else if (nfree > n_rows || 2 * (n_rows - nfree + n) > isz)
        /* the live rows and the batch's: an index too small for them ran full mid-batch,
         * after the first keys were written (rev7) */
        bad = "no room made in the index (at most half full after the batch)";
    for (Py_ssize_t i = 0; i < n && !bad; i++)
        if (slots[i] < 0 || slots[i] >= p || slots[i] >= nsr)
            bad = "a slot out of range";
    if (bad) {
        PyErr_Format(PyExc_ValueError, "put_rows: %s", bad);
        goto fail;
    }
    /* The scratch: the keys' hashes (kept for the insert), a set of them, a set of the slots. */
    Py_ssize_t scap = 16;
    while (scap < 2 * n)
        scap *= 2;
    h = PyMem_Malloc((size_t)(n + 3 * scap + 1) * sizeof(uint64_t));
    if (h == NULL) {
        PyErr_NoMemory();
        goto fail;
    }
    uint64_t *set = h + n, *used = set + scap;
    int64_t *sset = (int64_t *)(used + scap);
    memset(used, 0, (size_t)scap * sizeof(uint64_t));
    memset(sset, 0xff, (size_t)scap * sizeof(int64_t));
    /* No slot given twice, and none that a row's copy in tier still sits in (its slot column
     * names it, its copy_ver is set): either puts two rows on one slot's bytes, and one of
     * them serves the other's block (rev7). */
    const int32_t *slotc = col[9];
    const uint64_t *cver = col[10];
    for (Py_ssize_t i = 0; i < n && !bad; i++) {
        int64_t sl = slots[i], o = slot_row[sl];
        uint64_t at = ((uint64_t)sl * MIX1) & (uint64_t)(scap - 1);
        while (sset[at] >= 0 && sset[at] != sl)
            at = (at + 1) & (uint64_t)(scap - 1);
        if (sset[at] == sl)
            bad = "a slot given twice";
        else if (o >= 0 && o < n_rows && slotc[o * nsl + tier] == sl && cver[o * nt + tier])
            bad = "a slot that holds a row's copy";
        sset[at] = sl;
    }
    if (bad) {
        PyErr_Format(PyExc_ValueError, "put_rows: %s", bad);
        goto fail;
    }
    /* The rows the keys take, in order, checked: a free row inside the table, a fresh one
     * inside the columns, and each state with a COMMIT move. */
    int64_t *rows = outr;
    Py_ssize_t nf = nfree, nr = n_rows;
    uint8_t *state = col[5];
    for (Py_ssize_t i = 0; i < n && !bad; i++) {
        int64_t r;
        if (nf > 0) {
            r = freel[--nf];
            if (r < 0 || r >= n_rows)
                bad = "a free row outside the table";
        } else if ((r = nr++) >= cap) {
            bad = "no room made for the batch's fresh rows";
        }
        if (!bad && (state[r] >= nnext || next[state[r]] == 255))
            bad = "a row whose state has no COMMIT move";
        rows[i] = r;
    }
    if (bad) {
        PyErr_Format(PyExc_ValueError, "put_rows: %s", bad);
        goto fail;
    }
    /* Every key absent (else None), none repeated (the set of hashes), data outside the
     * pool; the hashes kept for the insert. */
    uint64_t mask = (uint64_t)isz - 1;
    const uint8_t *keycol = col[0];
    int handled = 1, corrupt = 0;
    for (Py_ssize_t i = 0; i < n && handled && !corrupt; i++) {
        const uint8_t *key = keys + i * width;
        h[i] = hash_one(key, width);
        int64_t found = probe_key(index, mask, keycol, n_rows, key, width);
        if (found == CORRUPT)
            corrupt = 1;
        else if (found >= 0)
            handled = 0;
        uint64_t at = h[i] & (uint64_t)(scap - 1);
        while (used[at] && set[at] != h[i])
            at = (at + 1) & (uint64_t)(scap - 1);
        if (used[at])
            handled = 0;
        used[at] = 1;
        set[at] = h[i];
    }
    if (handled && n > 0) {
        uintptr_t a0 = (uintptr_t)pool, a1 = a0 + (uintptr_t)(p * pw);
        uintptr_t d0 = (uintptr_t)data, d1 = d0 + (uintptr_t)(n * pw);
        if (d0 < a1 && a0 < d1)
            handled = 0;
    }
    if (corrupt || !handled) {
        PyMem_Free(h);
        views_release(&v);
        if (corrupt) {
            PyErr_SetString(PyExc_RuntimeError, "put_rows: the index names a row past the key "
                            "column");
            return NULL;
        }
        Py_RETURN_NONE;
    }
    /* The writes: keys and index, the pool's rows and their hashes, the install. */
    xxh3_fn fn = (xxh3_fn)fnp;
    InstallCols ic = {col[1], col[2], col[3], col[4], col[5], col[6], col[7], col[8], col[9],
                      nsl, col[10], nt, slot_row};
    uint64_t top = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t pos = h[i] & mask;
        uint64_t probes = 0;
        while (index[pos] >= 0 && probes++ <= mask)
            pos = (pos + 1) & mask;
        if (index[pos] >= 0) {
            corrupt = 1;                          /* a full index: the caller made no room */
            break;
        }
        int64_t r = rows[i];
        memcpy((uint8_t *)keycol + r * width, keys + i * width, (size_t)width);
        index[pos] = (int32_t)r;
        uint8_t *dst = pool + slots[i] * pw;
        memcpy(dst, data + i * pw, (size_t)pw);
        uint64_t ver = install_one(&ic, r, 1, slots[i], fn(dst, (size_t)pw), next, tier,
                                   floor_, base, clock + (uint64_t)i + 1, (uint32_t)bb);
        outv[i] = ver;
        if (ver > top)
            top = ver;
    }
    int linked = 0;
    if (!corrupt) {
        /* The chain: each parent key's row (this batch's rows are in the index now). */
        int64_t *parents = (int64_t *)h;          /* the hashes are spent */
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t f = probe_key(index, mask, keycol, nr, pkeys + i * width, width);
            if (f == CORRUPT)
                corrupt = 2;
            parents[i] = f < 0 ? -1 : f;
        }
        linked = !corrupt && link_each(col[11], col[12], col[13], rows, parents, n) == 0;
    }
    PyMem_Free(h);
    views_release(&v);
    if (corrupt) {
        PyErr_SetString(PyExc_RuntimeError, corrupt == 1
                        ? "put_rows: the index is full (no room was made)"
                        : "put_rows: the index names a parent row past the key column");
        return NULL;
    }
    if (!linked)
        return NULL;                              /* link_each's MemoryError */
    return steal_tuple(3, PyLong_FromSsize_t(nr), PyLong_FromSsize_t(nf),
                       PyLong_FromUnsignedLongLong((unsigned long long)top));
fail:
    PyMem_Free(h);
    views_release(&v);
    return NULL;
}

static PyMethodDef methods[] = {
    {"hash_keys", (PyCFunction)(void (*)(void))hash_keys, METH_FASTCALL,
     "hash_keys(keys, width, out): table.py's key hash of each key into out (uint64)."},
    {"lookup", (PyCFunction)(void (*)(void))lookup, METH_FASTCALL,
     "lookup(index, keycol, width, keys, out[, n_rows]): the row of each key, or -1, into out."},
    {"index_insert", (PyCFunction)(void (*)(void))index_insert, METH_FASTCALL,
     "index_insert(index, rows, hashes): store each row along its probe sequence."},
    {"index_remove", (PyCFunction)(void (*)(void))index_remove, METH_FASTCALL,
     "index_remove(index, rows, hashes): each row's index entry becomes a tombstone."},
    {"link_rows", (PyCFunction)(void (*)(void))link_rows, METH_FASTCALL,
     "link_rows(parent, first_child, next_sib, rows, parents): table.py's link."},
    {"link_keys", (PyCFunction)(void (*)(void))link_keys, METH_FASTCALL,
     "link_keys(index, keycol, width, parent_keys, parent, first, next, rows, n_rows)."},
    {"unlink_rows", (PyCFunction)(void (*)(void))unlink_rows, METH_FASTCALL,
     "unlink_rows(parent, first_child, next_sib, rows): table.py's _unlink of each row."},
    {"remove_rows", (PyCFunction)(void (*)(void))remove_rows, METH_FASTCALL,
     "remove_rows(index, keycol, width, parent, first, next, version, rows, free, nfree)."},
    {"reset_rows", (PyCFunction)(void (*)(void))reset_rows, METH_FASTCALL,
     "reset_rows(columns, fills, rows): each column's rows set to its fill."},
    {"key_flags", (PyCFunction)(void (*)(void))key_flags, METH_FASTCALL,
     "key_flags(keys, width) -> bits: 1 an all-zero key, 2 a repeated hash."},
    {"insert_keys", (PyCFunction)(void (*)(void))insert_keys, METH_FASTCALL,
     "insert_keys(index, keycol, width, keys, free, nfree, n_rows, rows, created)."},
    {"put_rows", (PyCFunction)(void (*)(void))put_rows, METH_FASTCALL,
     "put_rows(...) -> (n_rows, nfree, top) or None: a host put of new keys (see _native.c)."},
    {"current_prefix", (PyCFunction)(void (*)(void))current_prefix, METH_FASTCALL,
     "current_prefix(index, keycol, width, keys, version, copy_ver, local, mem) -> (n, below)."},
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
