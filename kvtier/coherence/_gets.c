/* kvtier.coherence._gets: the first half of a get's decide in one call (coherence/gets.py).
 *
 * Why (issue 17, bench/stall.py: a resident get waits behind NVMe readers' locked steps on the
 * service's loop). Once lease_native has refused a batch (some block must move between tiers),
 * Gets._get split it into found / ready / to bring up with about twenty numpy calls (masks,
 * selections, the pins of what is already here, the versions and checksums pinned, a sort to
 * see repeats), each a microsecond or more, for work of a few hundred nanoseconds: a fifth of
 * the decide step that a resident get waits behind.
 *
 *   split_rows(version u64[c], copy_ver u64[c, t], slot i32[c, s], checksum u64[c],
 *              pool_leases u32[p], rows i64[n], n_rows, tier,
 *              out_found bool[n], out_slots i64[n], out_versions u64[n], out_sums u64[n],
 *              out_todo i64[n]) -> (k, hits, repeats)
 *       Per position i of rows (a lookup's result: -1 where the key is missing): found when
 *       the row exists with a version (> 0); then its version and checksum are the ones
 *       pinned (else 0, 0). A found row whose copy in tier is current (copy_ver == version)
 *       is ready: its slot is written to out_slots and pinned (pool_leases += 1 per
 *       occurrence), else out_slots is -1 and i goes to out_todo (in batch order). Returns
 *       k (positions in out_todo), hits (ready positions) and whether the rows of out_todo
 *       repeat. Everything is checked before anything is written: a row at or past n_rows,
 *       or a ready slot outside the pool, raises ValueError (a broken table, never input).
 *
 * No reference to any argument is kept. The GIL is held (under the engine lock; microseconds).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

#include "cviews.h"

static int cmp_i64(const void *a, const void *b)
{
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return x < y ? -1 : x > y;
}

static PyObject *split_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 13) {
        PyErr_SetString(PyExc_TypeError, "split_rows takes 13 arguments");
        return NULL;
    }
    Views v = {.n = 0};
    Py_ssize_t cap[4], nt, ns, np_, n, n_out[5], n_rows, tier;
    uint64_t *version = view(&v, args[0], 8, 0, &cap[0], NULL, "version");
    uint64_t *copy_ver = version ? view(&v, args[1], 8, 0, &cap[1], &nt, "copy_ver") : NULL;
    int32_t *slot = copy_ver ? view(&v, args[2], 4, 0, &cap[2], &ns, "slot") : NULL;
    uint64_t *sums = slot ? view(&v, args[3], 8, 0, &cap[3], NULL, "checksum") : NULL;
    uint32_t *pool = sums ? view(&v, args[4], 4, 1, &np_, NULL, "pool_leases") : NULL;
    int64_t *rows = pool ? view(&v, args[5], 8, 0, &n, NULL, "rows") : NULL;
    uint8_t *o_found = rows ? view(&v, args[8], 1, 1, &n_out[0], NULL, "out_found") : NULL;
    int64_t *o_slots = o_found ? view(&v, args[9], 8, 1, &n_out[1], NULL, "out_slots") : NULL;
    uint64_t *o_ver = o_slots ? view(&v, args[10], 8, 1, &n_out[2], NULL, "out_versions") : NULL;
    uint64_t *o_sum = o_ver ? view(&v, args[11], 8, 1, &n_out[3], NULL, "out_sums") : NULL;
    int64_t *o_todo = o_sum ? view(&v, args[12], 8, 1, &n_out[4], NULL, "out_todo") : NULL;
    int64_t *sorted = NULL;
    PyObject *result = NULL;
    if (o_todo == NULL || as_index(args[6], &n_rows, "n_rows") < 0
            || as_index(args[7], &tier, "tier") < 0)
        goto done;
    for (int i = 0; i < 4; i++)
        if (cap[i] < n_rows) {
            PyErr_SetString(PyExc_ValueError, "split_rows: a column is shorter than n_rows");
            goto done;
        }
    for (int i = 0; i < 5; i++)
        if (n_out[i] < n) {
            PyErr_SetString(PyExc_ValueError, "split_rows: an output is shorter than rows");
            goto done;
        }
    if (tier >= nt || tier >= ns) {
        PyErr_SetString(PyExc_ValueError, "split_rows: tier past the columns");
        goto done;
    }
    /* Check everything before writing anything. */
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        if (r >= n_rows) {
            PyErr_SetString(PyExc_ValueError, "split_rows: a row past the table");
            goto done;
        }
        if (r >= 0 && version[r] && copy_ver[r * nt + tier] == version[r]) {
            int32_t s = slot[r * ns + tier];
            if (s < 0 || s >= np_) {
                PyErr_SetString(PyExc_ValueError, "split_rows: a current copy's slot is "
                                "outside the pool");
                goto done;
            }
        }
    }
    sorted = malloc((size_t)(n ? n : 1) * sizeof *sorted);     /* before any write */
    if (sorted == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t k = 0, hits = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        if (r < 0 || version[r] == 0) {
            o_found[i] = 0;
            o_slots[i] = -1;
            o_ver[i] = 0;
            o_sum[i] = 0;
            continue;
        }
        o_found[i] = 1;
        o_ver[i] = version[r];
        o_sum[i] = sums[r];
        if (copy_ver[r * nt + tier] == version[r]) {
            int32_t s = slot[r * ns + tier];
            pool[s] += 1;
            o_slots[i] = s;
            hits++;
        } else {
            o_slots[i] = -1;
            o_todo[k++] = i;
        }
    }
    int repeats = 0;
    if (k > 1) {
        for (Py_ssize_t j = 0; j < k; j++)
            sorted[j] = rows[o_todo[j]];
        qsort(sorted, (size_t)k, sizeof *sorted, cmp_i64);
        for (Py_ssize_t j = 1; j < k && !repeats; j++)
            repeats = sorted[j] == sorted[j - 1];
    }
    result = Py_BuildValue("(nnO)", k, hits, repeats ? Py_True : Py_False);
done:
    free(sorted);
    views_release(&v);
    return result;
}

static PyMethodDef methods[] = {
    {"split_rows", (PyCFunction)(void (*)(void))split_rows, METH_FASTCALL,
     "split_rows(...): a get's batch split into found, ready (pinned) and to bring up."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_gets",
    "The first half of a get's decide in one call (see _gets.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__gets(void)
{
    return PyModule_Create(&module);
}
