/* kvtier.coherence._flush: a flush's pick and apply over the page table's columns, one C call
 * each (coherence/flushes.py; its numpy code is the fallback and the reference).
 *
 * Why. A 16-block write_through put of the randrw fio jobs ran ~35 numpy calls in _pick and
 * ~25 in _apply_flush and set_nvme, each of a microsecond or more for 16 rows: ~0.25 ms of a
 * put's ~1.3 ms of thread CPU on the dev VM (issue 17, fio7). What stays in Python is what
 * touches Python objects: the pins, the slot views, the segments' live counts and Members.
 *
 *   pick(rows i64[m], n_rows, dirty, host, hbm, flag_parent, block_bytes, (then the columns:)
 *        state u8[], version u64[], copy_ver u64[, T], slot i32[, S], checksum u64[],
 *        key V[w], parent i32[],
 *        out_rows i64[m], out_versions u64[m], out_slots i64[m], out_sums u64[m],
 *        out_keys V[w][m], out_records rec[m], w) -> (k, distinct, staged)
 *       The DIRTY rows among rows (each once; rows outside 0..n_rows-1 are left out), oldest
 *       version first (ties by row), those whose host (else HBM) copy holds the version; the
 *       first k entries of each out array: the row, its version, its host slot (-1: the copy
 *       is HBM's, to be staged), its checksum, its key and its LMDB record (size, flags,
 *       version, checksum and parent key set; seg, off and binding left as given: zeros).
 *       distinct: rows named no row twice. staged: how many of the k have slot -1.
 *       out_records: the record dtype of pagetable/store.py (40 + w bytes, fields at
 *       0 seg, 4 off, 8 size, 12 flags, 16 version, 24 checksum, 32 binding, 40 parent).
 *
 *   apply(n_rows, nvme, flushed u8[states],
 *         rows i64[k], keys V[w][k], versions u64[k], segs i32[k], offs u32[k], sums u64[k],
 *         key V[w], version u64[], copy_ver u64[, T], slot i32[, S], nvme_off u32[],
 *         nvme_checksum u64[], state u8[], out_m i64[k], out_old i32[k], w)
 *         -> (n_m, n_old, bad)
 *       Batch entry i is installed where its row still holds keys[i] at versions[i] or a
 *       newer version: its NVMe slot, offset, copy version and checksum become segs[i],
 *       offs[i], versions[i], sums[i]; out_m lists the installed i (ascending), out_old the
 *       NVMe segment each of them held before (for those that held one). Then the installed
 *       rows whose version is versions[i] move by the table flushed (FLUSHED's transitions);
 *       if any of them has no legal move (255), no state is written and bad is that state
 *       plus one (the caller raises IllegalTransition), else bad is 0.
 *
 * Bad arguments (wrong item sizes, short columns, a tier index past a column's width, a
 * parent row outside the key column) are a TypeError or ValueError with nothing written.
 * No reference to any argument is kept; the GIL is held (the engine lock serialises calls). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cviews.h"

#define REC_SIZE 8
#define REC_FLAGS 12
#define REC_VERSION 16
#define REC_CHECKSUM 24
#define REC_PARENT 40

typedef struct {
    uint64_t version;
    int64_t row;
} Pair;

static int by_row(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static int by_version_row(const void *a, const void *b)
{
    const Pair *x = a, *y = b;
    if (x->version != y->version)
        return x->version < y->version ? -1 : 1;
    return (x->row > y->row) - (x->row < y->row);
}

static int as_count(PyObject *obj, Py_ssize_t *out, const char *name)
{
    return as_index(obj, out, name);
}

static PyObject *pick(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 21) {
        PyErr_SetString(PyExc_TypeError, "pick takes 21 arguments");
        return NULL;
    }
    Py_ssize_t n_rows, dirty, host, hbm, flag_parent, block_bytes, w;
    if (as_count(args[1], &n_rows, "n_rows") < 0 || as_count(args[2], &dirty, "dirty") < 0
            || as_count(args[3], &host, "host") < 0 || as_count(args[4], &hbm, "hbm") < 0
            || as_count(args[5], &flag_parent, "flag_parent") < 0
            || as_count(args[6], &block_bytes, "block_bytes") < 0
            || as_count(args[20], &w, "w") < 0)
        return NULL;
    if (dirty > 255 || flag_parent > UINT32_MAX || block_bytes > UINT32_MAX || w < 1
            || w > 4096) {
        PyErr_SetString(PyExc_ValueError,
                        "dirty, flag_parent, block_bytes or the key width out of range");
        return NULL;
    }
    Views v = {.n = 0};
    PyObject *res = NULL;
    Pair *pairs = NULL;
    Py_ssize_t m, ls, lv, lc, tc, lsl, sc, lck, lk, lp;
    Py_ssize_t om, ov, os_, osu, okl, orl;
    const int64_t *rows = view(&v, args[0], 8, 0, &m, NULL, "rows");
    if (rows == NULL)
        goto done;
    const uint8_t *state = view(&v, args[7], 1, 0, &ls, NULL, "state");
    const uint64_t *version = state ? view(&v, args[8], 8, 0, &lv, NULL, "version") : NULL;
    const uint64_t *copy_ver = version ? view(&v, args[9], 8, 0, &lc, &tc, "copy_ver") : NULL;
    const int32_t *slot = copy_ver ? view(&v, args[10], 4, 0, &lsl, &sc, "slot") : NULL;
    const uint64_t *checksum = slot ? view(&v, args[11], 8, 0, &lck, NULL, "checksum") : NULL;
    const uint8_t *key = checksum ? view(&v, args[12], w, 0, &lk, NULL, "key") : NULL;
    const int32_t *parent = key ? view(&v, args[13], 4, 0, &lp, NULL, "parent") : NULL;
    int64_t *o_rows = parent ? view(&v, args[14], 8, 1, &om, NULL, "out_rows") : NULL;
    uint64_t *o_ver = o_rows ? view(&v, args[15], 8, 1, &ov, NULL, "out_versions") : NULL;
    int64_t *o_slot = o_ver ? view(&v, args[16], 8, 1, &os_, NULL, "out_slots") : NULL;
    uint64_t *o_sum = o_slot ? view(&v, args[17], 8, 1, &osu, NULL, "out_sums") : NULL;
    uint8_t *o_key = o_sum ? view(&v, args[18], w, 1, &okl, NULL, "out_keys") : NULL;
    uint8_t *o_rec = o_key ? view(&v, args[19], REC_PARENT + w, 1, &orl, NULL, "out_records")
                           : NULL;
    if (o_rec == NULL)
        goto done;
    if (n_rows > ls || n_rows > lv || n_rows > lc || n_rows > lsl || n_rows > lck
            || n_rows > lk || n_rows > lp) {
        PyErr_SetString(PyExc_ValueError, "n_rows is past a column's length");
        goto done;
    }
    if (host >= tc || hbm >= tc || host >= sc) {
        PyErr_SetString(PyExc_ValueError, "a tier index is past a column's width");
        goto done;
    }
    if (om < m || ov < m || os_ < m || osu < m || okl < m || orl < m) {
        PyErr_SetString(PyExc_ValueError, "an out array is shorter than rows");
        goto done;
    }
    /* The rows, sorted and each once, in range and DIRTY: o_rows is the scratch. */
    memcpy(o_rows, rows, (size_t)m * sizeof(int64_t));
    int sorted = 1;
    for (Py_ssize_t i = 1; i < m && sorted; i++)
        sorted = o_rows[i - 1] < o_rows[i];
    int distinct = 1;
    int64_t rows_prev = -1;
    if (!sorted) {
        qsort(o_rows, (size_t)m, sizeof(int64_t), by_row);
        for (Py_ssize_t i = 1; i < m && distinct; i++)
            distinct = o_rows[i - 1] != o_rows[i];
    }
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        int64_t r = o_rows[i];
        int repeat = i > 0 && r == rows_prev;
        rows_prev = r;
        if (repeat || r < 0 || r >= n_rows || state[r] != (uint8_t)dirty)
            continue;
        o_rows[n++] = r;
    }
    /* Check every parent before anything is written past the scratch. */
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t p = parent[o_rows[i]];
        if (p >= 0 && p >= lk) {
            PyErr_SetString(PyExc_ValueError, "a parent row is outside the key column");
            goto done;
        }
    }
    pairs = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(Pair));
    if (pairs == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        pairs[i].row = o_rows[i];
        pairs[i].version = version[o_rows[i]];
    }
    int ordered = 1;
    for (Py_ssize_t i = 1; i < n && ordered; i++)
        ordered = pairs[i - 1].version <= pairs[i].version;
    if (!ordered)
        qsort(pairs, (size_t)n, sizeof(Pair), by_version_row);
    Py_ssize_t k = 0, staged = 0;
    size_t rs = (size_t)(REC_PARENT + w);
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = pairs[i].row;
        uint64_t ver = pairs[i].version;
        int on_host = copy_ver[r * tc + host] == ver;
        if (!on_host && copy_ver[r * tc + hbm] != ver)
            continue;                 /* a DIRTY row always has one; never trust it blindly */
        o_rows[k] = r;
        o_ver[k] = ver;
        o_slot[k] = on_host ? (int64_t)slot[r * sc + host] : -1;
        staged += !on_host;
        o_sum[k] = checksum[r];
        memcpy(o_key + (size_t)k * w, key + (size_t)r * w, (size_t)w);
        uint8_t *rec = o_rec + (size_t)k * rs;
        uint32_t size = (uint32_t)block_bytes, flags = 0;
        int32_t p = parent[r];
        if (p >= 0) {
            flags = (uint32_t)flag_parent;
            memcpy(rec + REC_PARENT, key + (size_t)p * w, (size_t)w);
        }
        memcpy(rec + REC_SIZE, &size, 4);
        memcpy(rec + REC_FLAGS, &flags, 4);
        memcpy(rec + REC_VERSION, &ver, 8);
        memcpy(rec + REC_CHECKSUM, &checksum[r], 8);
        k++;
    }
    res = Py_BuildValue("(nOn)", k, distinct ? Py_True : Py_False, staged);
done:
    PyMem_Free(pairs);
    views_release(&v);
    return res;
}

static PyObject *apply(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 19) {
        PyErr_SetString(PyExc_TypeError, "apply takes 19 arguments");
        return NULL;
    }
    Py_ssize_t n_rows, nvme, w;
    if (as_count(args[0], &n_rows, "n_rows") < 0 || as_count(args[1], &nvme, "nvme") < 0
            || as_count(args[18], &w, "w") < 0)
        return NULL;
    if (w < 1 || w > 4096) {
        PyErr_SetString(PyExc_ValueError, "the key width is out of range");
        return NULL;
    }
    Views v = {.n = 0};
    PyObject *res = NULL;
    Py_ssize_t ns_, k, lk2, lv2, lsg, lof, lsu, lk, lv, lc, tc, lsl, sc, lno, lnc, ls, lm, lo;
    const uint8_t *flushed = view(&v, args[2], 1, 0, &ns_, NULL, "flushed");
    const int64_t *rows = flushed ? view(&v, args[3], 8, 0, &k, NULL, "rows") : NULL;
    const uint8_t *keys = rows ? view(&v, args[4], w, 0, &lk2, NULL, "keys") : NULL;
    const uint64_t *vers = keys ? view(&v, args[5], 8, 0, &lv2, NULL, "versions") : NULL;
    const int32_t *segs = vers ? view(&v, args[6], 4, 0, &lsg, NULL, "segs") : NULL;
    const uint32_t *offs = segs ? view(&v, args[7], 4, 0, &lof, NULL, "offs") : NULL;
    const uint64_t *sums = offs ? view(&v, args[8], 8, 0, &lsu, NULL, "sums") : NULL;
    const uint8_t *key = sums ? view(&v, args[9], w, 0, &lk, NULL, "key") : NULL;
    const uint64_t *version = key ? view(&v, args[10], 8, 0, &lv, NULL, "version") : NULL;
    uint64_t *copy_ver = version ? view(&v, args[11], 8, 1, &lc, &tc, "copy_ver") : NULL;
    int32_t *slot = copy_ver ? view(&v, args[12], 4, 1, &lsl, &sc, "slot") : NULL;
    uint32_t *nvme_off = slot ? view(&v, args[13], 4, 1, &lno, NULL, "nvme_off") : NULL;
    uint64_t *nvme_sum = nvme_off ? view(&v, args[14], 8, 1, &lnc, NULL, "nvme_checksum")
                                  : NULL;
    uint8_t *state = nvme_sum ? view(&v, args[15], 1, 1, &ls, NULL, "state") : NULL;
    int64_t *o_m = state ? view(&v, args[16], 8, 1, &lm, NULL, "out_m") : NULL;
    int32_t *o_old = o_m ? view(&v, args[17], 4, 1, &lo, NULL, "out_old") : NULL;
    if (o_old == NULL)
        goto done;
    if (lk2 != k || lv2 != k || lsg != k || lof != k || lsu != k) {
        PyErr_SetString(PyExc_ValueError, "the batch's arrays differ in length");
        goto done;
    }
    if (n_rows > lk || n_rows > lv || n_rows > lc || n_rows > lsl || n_rows > lno
            || n_rows > lnc || n_rows > ls) {
        PyErr_SetString(PyExc_ValueError, "n_rows is past a column's length");
        goto done;
    }
    if (nvme >= tc || nvme >= sc) {
        PyErr_SetString(PyExc_ValueError, "the NVMe tier index is past a column's width");
        goto done;
    }
    if (lm < k || lo < k) {
        PyErr_SetString(PyExc_ValueError, "an out array is shorter than rows");
        goto done;
    }
    Py_ssize_t n_m = 0, n_old = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        int64_t r = rows[i];
        if (r < 0 || r >= n_rows || version[r] == 0 || version[r] < vers[i]
                || memcmp(key + (size_t)r * w, keys + (size_t)i * w, (size_t)w) != 0)
            continue;
        o_m[n_m++] = i;
    }
    /* The old copies first, as set_nvme reads them before it writes (a row named twice,
     * never from pick, counts its old copy twice there too). */
    for (Py_ssize_t j = 0; j < n_m; j++) {
        int64_t r = rows[o_m[j]];
        if (copy_ver[r * tc + nvme] > 0)
            o_old[n_old++] = slot[r * sc + nvme];
    }
    for (Py_ssize_t j = 0; j < n_m; j++) {
        Py_ssize_t i = o_m[j];
        int64_t r = rows[i];
        slot[r * sc + nvme] = segs[i];
        nvme_off[r] = offs[i];
        copy_ver[r * tc + nvme] = vers[i];
        nvme_sum[r] = sums[i];
    }
    long bad = 0;
    for (Py_ssize_t j = 0; j < n_m && !bad; j++) {
        Py_ssize_t i = o_m[j];
        int64_t r = rows[i];
        if (version[r] == vers[i] && (state[r] >= ns_ || flushed[state[r]] == 255))
            bad = (long)state[r] + 1;
    }
    if (!bad)
        for (Py_ssize_t j = 0; j < n_m; j++) {
            Py_ssize_t i = o_m[j];
            int64_t r = rows[i];
            if (version[r] == vers[i])
                state[r] = flushed[state[r]];
        }
    res = Py_BuildValue("(nnl)", n_m, n_old, bad);
done:
    views_release(&v);
    return res;
}

static PyMethodDef methods[] = {
    {"pick", (PyCFunction)(void (*)(void))pick, METH_FASTCALL,
     "A flush's DIRTY rows, oldest version first, with their records (see the module)."},
    {"apply", (PyCFunction)(void (*)(void))apply, METH_FASTCALL,
     "Install a durable batch's NVMe copies where the rows still hold them."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_flush",
    "A flush's pick and apply over the page table's columns (coherence/flushes.py).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__flush(void)
{
    return PyModule_Create(&module);
}
