/* kvtier.coherence._fast: the bookkeeping of a resident batch get and of its release, and of
 * a put's rows, in C.
 *
 * Why. A get of 64 resident keys spent ~40 us in Engine._get and ~17 us in release_many on the
 * dev VM: about 30 numpy calls of a microsecond each over 64-element arrays, for work that is
 * a few hundred nanoseconds of loads and stores. That was a fifth of bench/api.py's batch get
 * and most of the service's share of it (docs/DESIGN-NOTES.md, "The resident get in C").
 * fastpath.py keeps the numpy version as the reference and the fallback where this module was
 * not built; the engine's tests run both and compare the state they leave field by field.
 *
 * Contract. Arrays are C-contiguous numpy arrays of the stated item sizes (checked); 2-D
 * columns are (capacity, tiers). Rows must be below n_rows, and slots below the pool's size;
 * anything else is refused before anything is written.
 *
 *   lease_rows(version u64[c], copy_ver u64[c, t], slot i32[c, s], leases u16[c],
 *              last_access u64[c], prev_access u64[c], freq u32[c], checksum u64[c],
 *              pool_leases u32[p], rows i64[n], n_rows, tier, clock,
 *              out_slots i32[n], out_versions u64[n], out_checksums u64[n]) -> bool
 *       When every row holds a current copy in tier (version > 0, copy_ver == version):
 *       pins the slots (pool_leases += 1 per occurrence), counts the readers (leases += 1 per
 *       occurrence, staying at 65,535 rather than wrap to 0), touches the rows as Engine._touch does (prev_access = the last_access
 *       before this batch; last_access = clock + i + 1, the last occurrence winning; freq + 1
 *       once per distinct row, as numpy's fancy += does), fills the outputs and returns True.
 *       Otherwise returns False and writes nothing: the caller takes the general path.
 *
 *   unlease_rows(pool_leases u32[p], retired bool[p], version u64[c], leases u16[c], n_rows,
 *                slots i64[n], rows i64[n], versions u64[n], out_gone i64[n]) -> int
 *       Ends the pins of a lease: pool_leases -= 1 per slot (never below zero); a retired slot
 *       whose last pin this was is un-retired and written to out_gone, once. Rows still at the
 *       leased version (and below n_rows) lose a reader (never below zero). Returns the number
 *       of slots in out_gone, which the caller hands back to the pool.
 *
 *   unlease_one(pool_leases u32[p], retired bool[p], version u64[c], leases u16[c], n_rows,
 *               slot, row, lease_version) -> bool
 *       unlease_rows for a lease of one slot, on Python ints (no arrays of the lease's own, so
 *       no buffer requests for them): True when the slot is to be freed by the caller.
 *
 *   unpin_slots(pool_leases u32[p], retired bool[p], slots i64[n], out_gone i64[n]) -> int
 *       Engine._unpin: unlease_rows's slot half.
 *
 *   pin_slots(pool_leases u32[p], slots i64[n]) -> None
 *       A reservation's pins: pool_leases += 1 per listed slot.
 *
 * A put's rows (issue 18: a request of ~25 keys paid ~500 Python and numpy calls, each a
 * microsecond or more on the dev VM, for work of a few hundred nanoseconds; issue 16: the
 * service's commit of 4,096 keys). engine.py and eviction.py keep their numpy versions as the
 * fallback; tests/test_engine.py runs one workload both ways and compares every column.
 *
 *   install_rows(version, leases, size, checksum, state, last_access, prev_access, freq,
 *                slot i32[c, s], copy_ver u64[c, t], slot_row i64[p], rows i64[n],
 *                created bool[n], slots i64[n], sums u64[n], commit_next u8[k], tier,
 *                floor, base, clock, block_size) -> top
 *       Engine._install's columns for distinct rows: a created row starts at floor; every
 *       version becomes max(version, base) + 1; readers 0, size, checksum; the state moves
 *       by commit_next (states.transition_array(COMMIT)); the touch as _touch does (clock +
 *       i + 1); the copy in tier placed (slot, copy_ver, slot_row). Returns the highest new
 *       version, or -1 with nothing written when some row's state has no COMMIT move.
 *   copy_slots(copy_ver, slot, rows, tier, out i64[n]) -> k
 *       The slots of the rows' copies in tier (copy_ver > 0), for the policy's on_remove.
 *   release_copies(copy_ver, slot, slot_row, pool_leases, retired, rows, tier, out_free) -> k
 *       Those copies forgotten (slot -1, copy_ver 0), their slots un-owned, retired while
 *       pinned, else written to out_free for the pool.
 *   empty_rows(version, copy_ver, state, checksum, nvme_checksum, rows, lost_next, nvme,
 *              clean, out_drop) -> k
 *       Eviction's _forget_empty: a row with a version and no current copy in any tier falls
 *       back to an older NVMe copy (version, checksum, state clean) or is written to out_drop
 *       for removal; -1 with nothing written when some such row has no LOST move.
 *   drop_rows(copy_ver, slot, slot_row, pool_leases, retired, rows, tier, out_free,
 *             version, state, checksum, nvme_checksum, lost_next, nvme, clean, out_drop)
 *       -> (k_free, k_drop)
 *       An eviction's victims in one call: release_copies(first eight arguments), then
 *       empty_rows over the same rows (k_drop: its result, -1 as there). The same effects
 *       in the same order as the two calls (the Python frames, casts and scratch arrays
 *       between them were most of a small eviction's cost, issue 18).
 *   evict_slots(copy_ver, slot, slot_row, pool_leases, retired, victims, tier, version,
 *               state, checksum, nvme_checksum, lost_next, nvme, clean, free_stack, low,
 *               scratch) -> (low, k_free, k_drop)
 *       The lowest tier's eviction of the policy's victim slots: their rows gathered into
 *       scratch[:n], drop_rows over them, the freed slots pushed onto the pool's free stack
 *       below low (SlotStack), the rows to remove in scratch[n:n + k_drop].
 *
 * A sorted get's order (kvtier.api.sortedgets; lease13, issue 16's small-page onboards: in the
 * service, numpy's version was ~0.25 ms of the first later piece's ~0.4 on the dev VM, the
 * piece that the GPU waits for after piece 0):
 *
 *   slot_order(version u64[c], copy_ver u64[c, t], slot i32[c, s], rows i64[n], n_rows,
 *              tier, out u32[n]) -> k
 *       The positions of rows (a lookup's, -1 for a miss) with a current copy in tier
 *       (version > 0, copy_ver == version, slot >= 0) into out[:k] by slot (a stable counting
 *       sort: a row asked twice keeps its order), then the others in their own order. Returns
 *       k; -1 when the current copies' slots span more than 4 k (sparse: out is not written,
 *       the caller sorts). A row at or past n_rows is a ValueError. Reads only.
 *
 * No reference to any argument is kept. The GIL is held: these run under the engine lock, on
 * batches that take microseconds.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "cviews.h"
#include "install.h"

static PyObject *lease_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 16) {
        PyErr_SetString(PyExc_TypeError, "lease_rows takes 16 arguments");
        return NULL;
    }
    Views v = {.n = 0};
    Py_ssize_t cap[8], nt, ns, np_, n, n_out[3], n_rows, tier;
    unsigned long long clock;
    uint64_t *version = view(&v, args[0], 8, 0, &cap[0], NULL, "version");
    uint64_t *copy_ver = version ? view(&v, args[1], 8, 0, &cap[1], &nt, "copy_ver") : NULL;
    int32_t *slot = copy_ver ? view(&v, args[2], 4, 0, &cap[2], &ns, "slot") : NULL;
    uint16_t *leases = slot ? view(&v, args[3], 2, 1, &cap[3], NULL, "leases") : NULL;
    uint64_t *last = leases ? view(&v, args[4], 8, 1, &cap[4], NULL, "last_access") : NULL;
    uint64_t *prev = last ? view(&v, args[5], 8, 1, &cap[5], NULL, "prev_access") : NULL;
    uint32_t *freq = prev ? view(&v, args[6], 4, 1, &cap[6], NULL, "freq") : NULL;
    uint64_t *sums = freq ? view(&v, args[7], 8, 0, &cap[7], NULL, "checksum") : NULL;
    uint32_t *pool = sums ? view(&v, args[8], 4, 1, &np_, NULL, "pool_leases") : NULL;
    int64_t *rows = pool ? view(&v, args[9], 8, 0, &n, NULL, "rows") : NULL;
    int32_t *o_slots = rows ? view(&v, args[13], 4, 1, &n_out[0], NULL, "out_slots") : NULL;
    uint64_t *o_ver = o_slots ? view(&v, args[14], 8, 1, &n_out[1], NULL, "out_versions") : NULL;
    uint64_t *o_sum = o_ver ? view(&v, args[15], 8, 1, &n_out[2], NULL, "out_checksums") : NULL;
    if (o_sum == NULL || as_index(args[10], &n_rows, "n_rows") < 0
            || as_index(args[11], &tier, "tier") < 0)
        goto fail;
    clock = PyLong_AsUnsignedLongLong(args[12]);
    if (clock == (unsigned long long)-1 && PyErr_Occurred())
        goto fail;
    for (int i = 0; i < 8; i++)
        if (cap[i] < n_rows) {
            PyErr_SetString(PyExc_ValueError, "a column is shorter than n_rows");
            goto fail;
        }
    if (tier >= nt || tier >= ns || n_out[0] < n || n_out[1] < n || n_out[2] < n) {
        PyErr_SetString(PyExc_ValueError, "tier past the columns, or outputs shorter than rows");
        goto fail;
    }
    /* Check everything before writing anything. */
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        if (r < 0 || r >= n_rows)
            goto refuse;
        uint64_t ver = version[r];
        int32_t s = slot[r * ns + tier];
        if (ver == 0 || copy_ver[r * nt + tier] != ver || s < 0 || s >= np_)
            goto refuse;
    }
    /* prev_access first, for every row, so that a repeated row's second occurrence still sees
     * its last_access from before the batch; while last == prev, r was not yet seen here. */
    for (Py_ssize_t i = 0; i < n; i++)
        prev[rows[i]] = last[rows[i]];
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        int32_t s = slot[r * ns + tier];
        pool[s] += 1;
        if (leases[r] < UINT16_MAX)                 /* saturates, as _gets.lease_current */
            leases[r] += 1;
        if (last[r] == prev[r])
            freq[r] += 1;                           /* the first occurrence of r */
        last[r] = clock + (uint64_t)i + 1;
        o_slots[i] = s;
        o_ver[i] = version[r];
        o_sum[i] = sums[r];
    }
    views_release(&v);
    Py_RETURN_TRUE;
refuse:
    views_release(&v);
    Py_RETURN_FALSE;
fail:
    views_release(&v);
    return NULL;
}

/* Every slot inside a pool of np_ slots; else ValueError naming fn. */
static int slots_in_pool(const int64_t *slots, Py_ssize_t n, Py_ssize_t np_, const char *fn)
{
    for (Py_ssize_t i = 0; i < n; i++)
        if (slots[i] < 0 || slots[i] >= np_) {
            PyErr_Format(PyExc_ValueError, "%s: a slot past the pool", fn);
            return -1;
        }
    return 0;
}

/* One pin of slot s less (never below zero): 1 when that was the last pin of a retired slot,
 * which is un-retired for the caller to free. */
static inline int unpin_one(uint32_t *pool, uint8_t *retired, int64_t s)
{
    if (pool[s] > 0 && --pool[s] == 0 && retired[s]) {
        retired[s] = 0;
        return 1;
    }
    return 0;
}

/* A reader less on row r when it still holds the version the lease read (and has readers). */
static inline void unlease_row(const uint64_t *version, uint16_t *leases, Py_ssize_t n_rows,
                               int64_t r, uint64_t ver)
{
    if (r >= 0 && r < n_rows && version[r] == ver && leases[r] > 0)
        leases[r] -= 1;
}

static PyObject *unlease_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "unlease_rows takes 9 arguments");
        return NULL;
    }
    Views v = {.n = 0};
    Py_ssize_t np_, nr, cv, cl, n, n_rows, nx[3];
    uint32_t *pool = view(&v, args[0], 4, 1, &np_, NULL, "pool_leases");
    uint8_t *retired = pool ? view(&v, args[1], 1, 1, &nr, NULL, "retired") : NULL;
    uint64_t *version = retired ? view(&v, args[2], 8, 0, &cv, NULL, "version") : NULL;
    uint16_t *leases = version ? view(&v, args[3], 2, 1, &cl, NULL, "leases") : NULL;
    int64_t *slots = leases ? view(&v, args[5], 8, 0, &n, NULL, "slots") : NULL;
    int64_t *rows = slots ? view(&v, args[6], 8, 0, &nx[0], NULL, "rows") : NULL;
    uint64_t *vers = rows ? view(&v, args[7], 8, 0, &nx[1], NULL, "versions") : NULL;
    int64_t *gone = vers ? view(&v, args[8], 8, 1, &nx[2], NULL, "out_gone") : NULL;
    if (gone == NULL || as_index(args[4], &n_rows, "n_rows") < 0)
        goto fail;
    if (nr != np_ || cv < n_rows || cl < n_rows || nx[0] != n || nx[1] != n || nx[2] < n) {
        PyErr_SetString(PyExc_ValueError, "unlease_rows: array lengths do not agree");
        goto fail;
    }
    if (slots_in_pool(slots, n, np_, "unlease_rows") < 0)
        goto fail;
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (unpin_one(pool, retired, slots[i]))
            gone[k++] = slots[i];
        unlease_row(version, leases, n_rows, rows[i], vers[i]);
    }
    views_release(&v);
    return PyLong_FromSsize_t(k);
fail:
    views_release(&v);
    return NULL;
}

/* unlease_one: unlease_rows for one slot, its arguments as Python ints. The replay's gets are
 * almost all of one block (1,483 of 1,499 in its first 1,500 requests), and the release of each
 * was eight numpy scalar operations (~12k instructions; round 5 of the replay's CPU). */
static PyObject *unlease_one(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "unlease_one takes 8 arguments");
        return NULL;
    }
    Views v = {.n = 0};
    Py_ssize_t np_, nr, cv, cl, n_rows, slot;
    uint32_t *pool = view(&v, args[0], 4, 1, &np_, NULL, "pool_leases");
    uint8_t *retired = pool ? view(&v, args[1], 1, 1, &nr, NULL, "retired") : NULL;
    uint64_t *version = retired ? view(&v, args[2], 8, 0, &cv, NULL, "version") : NULL;
    uint16_t *leases = version ? view(&v, args[3], 2, 1, &cl, NULL, "leases") : NULL;
    if (leases == NULL || as_index(args[4], &n_rows, "n_rows") < 0
            || as_index(args[5], &slot, "slot") < 0)
        goto fail;
    long long row = PyLong_AsLongLong(args[6]);
    if (row == -1 && PyErr_Occurred())
        goto fail;
    unsigned long long ver = PyLong_AsUnsignedLongLong(args[7]);
    if (ver == (unsigned long long)-1 && PyErr_Occurred())
        goto fail;
    if (nr != np_ || cv < n_rows || cl < n_rows) {
        PyErr_SetString(PyExc_ValueError, "unlease_one: array lengths do not agree");
        goto fail;
    }
    if (slot >= np_) {
        PyErr_SetString(PyExc_ValueError, "unlease_one: a slot past the pool");
        goto fail;
    }
    int gone = unpin_one(pool, retired, slot);
    unlease_row(version, leases, n_rows, row, ver);
    views_release(&v);
    return PyBool_FromLong(gone);
fail:
    views_release(&v);
    return NULL;
}

/* unpin_slots(pool_leases u32[p], retired bool[p], slots i64[n], out_gone i64[n]) -> k:
 * Engine._unpin: one pin less per listed slot (never below zero); a retired slot whose last
 * pin this was is un-retired and written to out_gone once, for the caller to free. */
static PyObject *unpin_slots(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "unpin_slots takes 4 arguments");
        return NULL;
    }
    Views v = {.n = 0};
    Py_ssize_t np_, nr, n, no;
    uint32_t *pool = view(&v, args[0], 4, 1, &np_, NULL, "pool_leases");
    uint8_t *retired = pool ? view(&v, args[1], 1, 1, &nr, NULL, "retired") : NULL;
    int64_t *slots = retired ? view(&v, args[2], 8, 0, &n, NULL, "slots") : NULL;
    int64_t *gone = slots ? view(&v, args[3], 8, 1, &no, NULL, "out_gone") : NULL;
    if (gone == NULL)
        goto fail;
    if (nr != np_ || no < n) {
        PyErr_SetString(PyExc_ValueError, "unpin_slots: array lengths do not agree");
        goto fail;
    }
    if (slots_in_pool(slots, n, np_, "unpin_slots") < 0)
        goto fail;
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (unpin_one(pool, retired, slots[i]))
            gone[k++] = slots[i];
    views_release(&v);
    return PyLong_FromSsize_t(k);
fail:
    views_release(&v);
    return NULL;
}

/* pin_slots(pool_leases u32[p], slots i64[n]) -> None: one pin more per listed slot (a
 * reservation's: numpy's fancy += on 25 slots cost ~5 us on the dev VM, 20 with the pool's
 * int32 slots). */
static PyObject *pin_slots(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "pin_slots takes 2 arguments");
        return NULL;
    }
    Views v = {.n = 0};
    Py_ssize_t np_, n;
    uint32_t *pool = view(&v, args[0], 4, 1, &np_, NULL, "pool_leases");
    int64_t *slots = pool ? view(&v, args[1], 8, 0, &n, NULL, "slots") : NULL;
    if (slots == NULL || slots_in_pool(slots, n, np_, "pin_slots") < 0) {
        views_release(&v);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        pool[slots[i]] += 1;
    views_release(&v);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- a put's rows (engine.py) */

static PyObject *install_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 21) {
        PyErr_SetString(PyExc_TypeError, "install_rows takes 21 arguments");
        return NULL;
    }
    Views v = {.n = 0};
    Py_ssize_t cap[10], nt, nsl, np_, n, nc, ns_, nn, tier;
    unsigned long long floor_, base, clock, bb;
    uint64_t *version = view(&v, args[0], 8, 1, &cap[0], NULL, "version");
    uint16_t *leases = version ? view(&v, args[1], 2, 1, &cap[1], NULL, "leases") : NULL;
    uint32_t *size = leases ? view(&v, args[2], 4, 1, &cap[2], NULL, "size") : NULL;
    uint64_t *sums = size ? view(&v, args[3], 8, 1, &cap[3], NULL, "checksum") : NULL;
    uint8_t *state = sums ? view(&v, args[4], 1, 1, &cap[4], NULL, "state") : NULL;
    uint64_t *last = state ? view(&v, args[5], 8, 1, &cap[5], NULL, "last_access") : NULL;
    uint64_t *prev = last ? view(&v, args[6], 8, 1, &cap[6], NULL, "prev_access") : NULL;
    uint32_t *freq = prev ? view(&v, args[7], 4, 1, &cap[7], NULL, "freq") : NULL;
    int32_t *slot = freq ? view(&v, args[8], 4, 1, &cap[8], &nsl, "slot") : NULL;
    uint64_t *copy_ver = slot ? view(&v, args[9], 8, 1, &cap[9], &nt, "copy_ver") : NULL;
    int64_t *slot_row = copy_ver ? view(&v, args[10], 8, 1, &np_, NULL, "slot_row") : NULL;
    int64_t *rows = slot_row ? view(&v, args[11], 8, 0, &n, NULL, "rows") : NULL;
    uint8_t *created = rows ? view(&v, args[12], 1, 0, &nc, NULL, "created") : NULL;
    int64_t *slots = created ? view(&v, args[13], 8, 0, &ns_, NULL, "slots") : NULL;
    uint64_t *given = slots ? view(&v, args[14], 8, 0, &nn, NULL, "sums") : NULL;
    Py_ssize_t nnext;
    uint8_t *next = given ? view(&v, args[15], 1, 0, &nnext, NULL, "commit_next") : NULL;
    if (next == NULL || as_index(args[16], &tier, "tier") < 0)
        goto fail;
    floor_ = PyLong_AsUnsignedLongLong(args[17]);
    base = PyErr_Occurred() ? 0 : PyLong_AsUnsignedLongLong(args[18]);
    clock = PyErr_Occurred() ? 0 : PyLong_AsUnsignedLongLong(args[19]);
    bb = PyErr_Occurred() ? 0 : PyLong_AsUnsignedLongLong(args[20]);
    if (PyErr_Occurred() || bb > UINT32_MAX) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "install_rows: a block size past 32 bits");
        goto fail;
    }
    for (int i = 1; i < 10; i++)
        if (cap[i] != cap[0]) {
            PyErr_SetString(PyExc_ValueError, "install_rows: columns of different lengths");
            goto fail;
        }
    if (nc != n || ns_ != n || nn != n || tier >= nt || tier >= nsl) {
        PyErr_SetString(PyExc_ValueError, "install_rows: one created flag, slot and checksum "
                        "per row, and a tier inside the columns");
        goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        if (r < 0 || r >= cap[0] || slots[i] < 0 || slots[i] >= np_) {
            PyErr_SetString(PyExc_ValueError, "install_rows: a row or slot out of range");
            goto fail;
        }
        if (state[r] >= nnext || next[state[r]] == 255) {
            views_release(&v);
            return PyLong_FromLong(-1);           /* the caller raises IllegalTransition */
        }
    }
    uint64_t top = 0;
    InstallCols c = {version, leases, size, sums, state, last, prev, freq, slot, nsl, copy_ver,
                     nt, slot_row};
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t ver = install_one(&c, rows[i], created[i], slots[i], given[i], next, tier,
                                   floor_, base, clock + (uint64_t)i + 1, (uint32_t)bb);
        if (ver > top)
            top = ver;
    }
    views_release(&v);
    return PyLong_FromUnsignedLongLong(top);
fail:
    views_release(&v);
    return NULL;
}

/* The tier's copy of each row that has one: its slot into out; returns how many. */
static PyObject *copy_slots(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "copy_slots takes 5 arguments");
        return NULL;
    }
    Views v = {.n = 0};
    Py_ssize_t c1, c2, nt, nsl, n, no, tier;
    uint64_t *copy_ver = view(&v, args[0], 8, 0, &c1, &nt, "copy_ver");
    int32_t *slot = copy_ver ? view(&v, args[1], 4, 0, &c2, &nsl, "slot") : NULL;
    int64_t *rows = slot ? view(&v, args[2], 8, 0, &n, NULL, "rows") : NULL;
    int64_t *out = rows ? view(&v, args[4], 8, 1, &no, NULL, "out") : NULL;
    if (out == NULL || as_index(args[3], &tier, "tier") < 0)
        goto fail;
    if (c1 != c2 || tier >= nt || tier >= nsl || no < n) {
        PyErr_SetString(PyExc_ValueError, "copy_slots: see _fast.c for the arrays");
        goto fail;
    }
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        if (r < 0 || r >= c1) {
            PyErr_SetString(PyExc_ValueError, "copy_slots: a row out of range");
            goto fail;
        }
        if (copy_ver[r * nt + tier] > 0)
            out[k++] = slot[r * nsl + tier];
    }
    views_release(&v);
    return PyLong_FromSsize_t(k);
fail:
    views_release(&v);
    return NULL;
}

/* Each row's copy in tier forgotten; its slot un-owned (slot_row -1), retired while pinned,
 * else into out_free. Returns how many were freed. */
/* A slot tier's copy columns and arrays, as release_copies and evict_slots take them:
 * copy_ver (rows x tiers), slot (rows x slot tiers), and the pool's slot_row, pool_leases and
 * retired (one entry per slot). */
typedef struct {
    uint64_t *copy_ver;
    int32_t *slot;
    int64_t *slot_row;
    uint32_t *pool;
    uint8_t *retired;
    Py_ssize_t rows, nt, nsl, slots;
} CopyCols;

/* The five arrays from a[0..4], their lengths checked against each other; -1 with an error. */
static int copy_views(Views *v, PyObject *const *a, CopyCols *c, const char *fn)
{
    Py_ssize_t c2, np2, np3;
    c->copy_ver = view(v, a[0], 8, 1, &c->rows, &c->nt, "copy_ver");
    c->slot = c->copy_ver ? view(v, a[1], 4, 1, &c2, &c->nsl, "slot") : NULL;
    c->slot_row = c->slot ? view(v, a[2], 8, 1, &c->slots, NULL, "slot_row") : NULL;
    c->pool = c->slot_row ? view(v, a[3], 4, 0, &np2, NULL, "pool_leases") : NULL;
    c->retired = c->pool ? view(v, a[4], 1, 1, &np3, NULL, "retired") : NULL;
    if (c->retired == NULL)
        return -1;
    if (c2 != c->rows || np2 != c->slots || np3 != c->slots) {
        PyErr_Format(PyExc_ValueError, "%s: see _fast.c for the arrays", fn);
        return -1;
    }
    return 0;
}

/* release_copies' work on the arrays' memory: every row (and the slot of its copy in tier)
 * checked before anything is written; -1 with ValueError, else how many slots were written to
 * out for the pool. */
static Py_ssize_t release_core(const CopyCols *c, const int64_t *rows, Py_ssize_t n,
                               Py_ssize_t tier, int64_t *out)
{
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        int32_t s = r >= 0 && r < c->rows ? c->slot[r * c->nsl + tier] : -1;
        if (r < 0 || r >= c->rows
                || (c->copy_ver[r * c->nt + tier] > 0 && (s < 0 || s >= c->slots))) {
            PyErr_SetString(PyExc_ValueError, "release_copies: a row or its slot out of range");
            return -1;
        }
    }
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        if (c->copy_ver[r * c->nt + tier] == 0)
            continue;
        int32_t s = c->slot[r * c->nsl + tier];
        c->slot_row[s] = -1;
        if (c->pool[s] > 0)
            c->retired[s] = 1;
        else
            out[k++] = s;
        c->slot[r * c->nsl + tier] = -1;
        c->copy_ver[r * c->nt + tier] = 0;
    }
    return k;
}

static PyObject *release_copies(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "release_copies takes 8 arguments");
        return NULL;
    }
    Views v = {.n = 0};
    CopyCols c;
    Py_ssize_t n, no, tier;
    int64_t *rows = NULL, *out = NULL;
    if (copy_views(&v, args, &c, "release_copies") < 0
            || (rows = view(&v, args[5], 8, 0, &n, NULL, "rows")) == NULL
            || (out = view(&v, args[7], 8, 1, &no, NULL, "out_free")) == NULL
            || as_index(args[6], &tier, "tier") < 0)
        goto fail;
    if (tier >= c.nt || tier >= c.nsl || no < n) {
        PyErr_SetString(PyExc_ValueError, "release_copies: see _fast.c for the arrays");
        goto fail;
    }
    Py_ssize_t k = release_core(&c, rows, n, tier, out);
    if (k < 0)
        goto fail;
    views_release(&v);
    return PyLong_FromSsize_t(k);
fail:
    views_release(&v);
    return NULL;
}

/* The columns empty_rows reads and writes besides copy_ver: version, state, checksum,
 * nvme_checksum (one entry per row), and the LOST transition table. */
typedef struct {
    uint64_t *version, *sums;
    const uint64_t *nsums;
    uint8_t *state;
    const uint8_t *lost;
    Py_ssize_t rows, nl;
} LostCols;

/* Those five from their arguments, the four columns' lengths checked; -1 with an error. */
static int lost_views(Views *v, PyObject *version, PyObject *state, PyObject *sums,
                      PyObject *nsums, PyObject *lost, LostCols *c, const char *fn)
{
    Py_ssize_t c2, c3, c4;
    c->version = view(v, version, 8, 1, &c->rows, NULL, "version");
    c->state = c->version ? view(v, state, 1, 1, &c2, NULL, "state") : NULL;
    c->sums = c->state ? view(v, sums, 8, 1, &c3, NULL, "checksum") : NULL;
    c->nsums = c->sums ? view(v, nsums, 8, 0, &c4, NULL, "nvme_checksum") : NULL;
    c->lost = c->nsums ? view(v, lost, 1, 0, &c->nl, NULL, "lost_next") : NULL;
    if (c->lost == NULL)
        return -1;
    if (c2 != c->rows || c3 != c->rows || c4 != c->rows) {
        PyErr_Format(PyExc_ValueError, "%s: see _fast.c for the arrays", fn);
        return -1;
    }
    return 0;
}

/* empty_rows' work on the arrays' memory (copy_ver: rows x nt): how many rows were written to
 * out, -1 (nothing written) when a row's state has no LOST move, -2 with ValueError for a row
 * out of range. */
static Py_ssize_t empty_core(const LostCols *c, const uint64_t *copy_ver, Py_ssize_t nt,
                             const int64_t *rows, Py_ssize_t n, Py_ssize_t nvme,
                             Py_ssize_t clean, int64_t *out)
{
    for (int pass = 0; pass < 2; pass++) {
        Py_ssize_t k = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t r = rows[i];
            if (r < 0 || r >= c->rows) {
                PyErr_SetString(PyExc_ValueError, "empty_rows: a row out of range");
                return -2;
            }
            uint64_t ver = c->version[r];
            if (ver == 0)
                continue;
            int cur = 0;
            for (Py_ssize_t t = 0; t < nt && !cur; t++)
                cur = copy_ver[r * nt + t] == ver;
            if (cur)
                continue;
            if (pass == 0) {
                if (c->state[r] >= c->nl || c->lost[c->state[r]] == 255)
                    return -1;
                continue;
            }
            uint64_t nv = copy_ver[r * nt + nvme];
            if (nv > 0) {
                c->version[r] = nv;
                c->sums[r] = c->nsums[r];
                c->state[r] = (uint8_t)clean;
            } else {
                out[k++] = r;
            }
        }
        if (pass == 1)
            return k;
    }
    return 0;                          /* not reached */
}

/* Eviction's _forget_empty: rows with a version and no current copy in any tier lose their
 * block. One whose NVMe tier (column nvme) holds an older, flushed version falls back to it
 * (version, checksum, state CLEAN); the others are written to out_drop for removal.
 * Returns how many, or -1 (nothing written) when a row's state has no LOST move. */
static PyObject *empty_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError, "empty_rows takes 10 arguments");
        return NULL;
    }
    Views v = {.n = 0};
    LostCols c;
    Py_ssize_t cc, nt, n, no, nvme, clean;
    uint64_t *copy_ver = NULL;
    int64_t *rows = NULL, *out = NULL;
    if (lost_views(&v, args[0], args[2], args[3], args[4], args[6], &c, "empty_rows") < 0
            || (copy_ver = view(&v, args[1], 8, 0, &cc, &nt, "copy_ver")) == NULL
            || (rows = view(&v, args[5], 8, 0, &n, NULL, "rows")) == NULL
            || (out = view(&v, args[9], 8, 1, &no, NULL, "out_drop")) == NULL
            || as_index(args[7], &nvme, "nvme") < 0 || as_index(args[8], &clean, "clean") < 0)
        goto fail;
    if (cc != c.rows || nvme >= nt || no < n) {
        PyErr_SetString(PyExc_ValueError, "empty_rows: see _fast.c for the arrays");
        goto fail;
    }
    Py_ssize_t k = empty_core(&c, copy_ver, nt, rows, n, nvme, clean, out);
    if (k < -1)
        goto fail;
    views_release(&v);
    return PyLong_FromSsize_t(k);
fail:
    views_release(&v);
    return NULL;
}

static PyObject *drop_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 16) {
        PyErr_SetString(PyExc_TypeError, "drop_rows takes 16 arguments");
        return NULL;
    }
    PyObject *freed = release_copies(self, args, 8);
    if (freed == NULL)
        return NULL;
    PyObject *const eargs[10] = {args[8], args[0], args[9], args[10], args[11], args[5],
                                 args[12], args[13], args[14], args[15]};
    PyObject *dropped = empty_rows(self, eargs, 10);
    if (dropped == NULL) {
        Py_DECREF(freed);
        return NULL;
    }
    return Py_BuildValue("NN", freed, dropped);
}

/* evict_slots(copy_ver, slot, slot_row, pool_leases, retired, victims, tier, version, state,
 *             checksum, nvme_checksum, lost_next, nvme, clean, free_stack, low, scratch)
 *     -> (low, k_free, k_drop)
 * The lowest tier's eviction of the policy's victims (slots) in one call: their rows
 * (slot_row, into scratch[:n]), release_copies of those rows, the freed slots pushed onto the
 * pool's free stack (kvtier.tiers.slots.SlotStack: free_stack[low - k_free:low], in the order
 * release_copies gave them, as SlotStack.free pushes a batch), then empty_rows over the rows
 * (k_drop of them into scratch[n:], -1 as there). The same effects in the same order as
 * drop_rows and SlotStack.free; the victims' row gather, the scratch arrays and their slices
 * between those calls were a replayed request's largest piece of glue (round 4). Every
 * victim is checked (a slot of the pool holding a row) before anything is written; a stack
 * without room for the freed slots (a double free) raises RuntimeError after the release, as
 * SlotStack.free raises after drop_rows. */
static PyObject *evict_slots(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 17) {
        PyErr_SetString(PyExc_TypeError, "evict_slots takes 17 arguments");
        return NULL;
    }
    Views v = {.n = 0};
    CopyCols c;
    LostCols l;
    Py_ssize_t n, tier, nvme, clean, nstack, low, nsc;
    int64_t *victims = NULL, *stack = NULL, *scratch = NULL;
    if (copy_views(&v, args, &c, "evict_slots") < 0
            || (victims = view(&v, args[5], 8, 0, &n, NULL, "victims")) == NULL
            || lost_views(&v, args[7], args[8], args[9], args[10], args[11], &l,
                          "evict_slots") < 0
            || (stack = view(&v, args[14], 8, 1, &nstack, NULL, "free_stack")) == NULL
            || (scratch = view(&v, args[16], 8, 1, &nsc, NULL, "scratch")) == NULL
            || as_index(args[6], &tier, "tier") < 0 || as_index(args[12], &nvme, "nvme") < 0
            || as_index(args[13], &clean, "clean") < 0 || as_index(args[15], &low, "low") < 0)
        goto fail;
    if (l.rows != c.rows || tier >= c.nt || tier >= c.nsl || nvme >= c.nt
            || nstack != c.slots || low > nstack || nsc < 2 * n) {
        PyErr_SetString(PyExc_ValueError, "evict_slots: see _fast.c for the arrays");
        goto fail;
    }
    int64_t *rows = scratch, *freed = scratch + n;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t s = victims[i];
        if (s < 0 || s >= c.slots || c.slot_row[s] < 0 || c.slot_row[s] >= c.rows) {
            PyErr_SetString(PyExc_ValueError, "evict_slots: a victim is not a slot holding a row");
            goto fail;
        }
        rows[i] = c.slot_row[s];
    }
    Py_ssize_t k = release_core(&c, rows, n, tier, freed);
    if (k < 0)
        goto fail;
    if (k > low) {
        PyErr_SetString(PyExc_RuntimeError, "evict_slots: more slots freed than allocated "
                        "(double free)");
        goto fail;
    }
    memcpy(stack + (low - k), freed, (size_t)k * sizeof(int64_t));
    Py_ssize_t d = empty_core(&l, c.copy_ver, c.nt, rows, n, nvme, clean, scratch + n);
    if (d < -1)
        goto fail;
    views_release(&v);
    return Py_BuildValue("nnn", low - k, k, d);
fail:
    views_release(&v);
    return NULL;
}

/* slot_order: see the header. Two passes over rows (each position's slot, then the counting
 * sort's placement); the counts span the slots' range, at most 4 k + 1 entries. */
static PyObject *slot_order(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "slot_order takes 7 arguments");
        return NULL;
    }
    Views v = {.n = 0};
    Py_ssize_t cap[3], nt, ns, n, no, n_rows, tier, k = 0;
    int32_t *at = NULL;
    uint32_t *counts = NULL;
    PyObject *res = NULL;
    uint64_t *version = view(&v, args[0], 8, 0, &cap[0], NULL, "version");
    uint64_t *copy_ver = version ? view(&v, args[1], 8, 0, &cap[1], &nt, "copy_ver") : NULL;
    int32_t *slot = copy_ver ? view(&v, args[2], 4, 0, &cap[2], &ns, "slot") : NULL;
    int64_t *rows = slot ? view(&v, args[3], 8, 0, &n, NULL, "rows") : NULL;
    uint32_t *out = rows ? view(&v, args[6], 4, 1, &no, NULL, "out") : NULL;
    if (out == NULL || as_index(args[4], &n_rows, "n_rows") < 0
            || as_index(args[5], &tier, "tier") < 0)
        goto done;
    if (cap[0] < n_rows || cap[1] < n_rows || cap[2] < n_rows || tier >= nt || tier >= ns
            || no < n || n > (Py_ssize_t)UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "slot_order: columns shorter than n_rows, tier past "
                        "them, or out shorter than rows");
        goto done;
    }
    at = PyMem_Malloc((size_t)(n ? n : 1) * sizeof(int32_t));   /* each position's slot */
    if (at == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int32_t smin = INT32_MAX, smax = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        int32_t s = -1;
        if (r >= n_rows) {
            PyErr_SetString(PyExc_ValueError, "slot_order: a row past n_rows");
            goto done;
        }
        if (r >= 0) {
            uint64_t ver = version[r];
            if (ver != 0 && copy_ver[r * nt + tier] == ver)
                s = slot[r * ns + tier];
        }
        at[i] = s < 0 ? -1 : s;
        if (s >= 0) {
            k++;
            smin = s < smin ? s : smin;
            smax = s > smax ? s : smax;
        }
    }
    Py_ssize_t span = k ? (Py_ssize_t)smax - smin + 1 : 0;
    if (span > 4 * k) {
        res = PyLong_FromLong(-1);
        goto done;
    }
    counts = PyMem_Calloc((size_t)span + 1, sizeof(uint32_t));
    if (counts == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (at[i] >= 0)
            counts[at[i] - smin + 1]++;
    for (Py_ssize_t j = 1; j <= span; j++)
        counts[j] += counts[j - 1];             /* counts[j]: the first place of slot smin + j */
    Py_ssize_t rest = k;
    for (Py_ssize_t i = 0; i < n; i++)
        out[at[i] >= 0 ? counts[at[i] - smin]++ : rest++] = (uint32_t)i;
    res = PyLong_FromSsize_t(k);
done:
    PyMem_Free(at);
    PyMem_Free(counts);
    views_release(&v);
    return res;
}

static PyMethodDef methods[] = {
    {"lease_rows", (PyCFunction)(void (*)(void))lease_rows, METH_FASTCALL,
     "lease_rows(...): pin and touch a batch of resident rows, or False (see _fast.c)."},
    {"unlease_rows", (PyCFunction)(void (*)(void))unlease_rows, METH_FASTCALL,
     "unlease_rows(...): end a lease's pins; returns how many slots it freed (see _fast.c)."},
    {"unlease_one", (PyCFunction)(void (*)(void))unlease_one, METH_FASTCALL,
     "unlease_one(...) -> bool: unlease_rows for one slot, on ints (see _fast.c)."},
    {"pin_slots", (PyCFunction)(void (*)(void))pin_slots, METH_FASTCALL,
     "pin_slots(pool_leases, slots) -> None: one pin more per slot (see _fast.c)."},
    {"unpin_slots", (PyCFunction)(void (*)(void))unpin_slots, METH_FASTCALL,
     "unpin_slots(pool_leases, retired, slots, out_gone) -> k: Engine._unpin (see _fast.c)."},
    {"install_rows", (PyCFunction)(void (*)(void))install_rows, METH_FASTCALL,
     "install_rows(...): a commit's columns, touch and copy placement (see _fast.c)."},
    {"copy_slots", (PyCFunction)(void (*)(void))copy_slots, METH_FASTCALL,
     "copy_slots(copy_ver, slot, rows, tier, out) -> k: the slots of rows' copies in tier."},
    {"release_copies", (PyCFunction)(void (*)(void))release_copies, METH_FASTCALL,
     "release_copies(copy_ver, slot, slot_row, leases, retired, rows, tier, out) -> k freed."},
    {"empty_rows", (PyCFunction)(void (*)(void))empty_rows, METH_FASTCALL,
     "empty_rows(...) -> k rows to remove, or -1: eviction's _forget_empty (see _fast.c)."},
    {"drop_rows", (PyCFunction)(void (*)(void))drop_rows, METH_FASTCALL,
     "drop_rows(...) -> (k_free, k_drop): release_copies then empty_rows (see _fast.c)."},
    {"evict_slots", (PyCFunction)(void (*)(void))evict_slots, METH_FASTCALL,
     "evict_slots(...) -> (low, k_free, k_drop): the lowest tier's eviction (see _fast.c)."},
    {"slot_order", (PyCFunction)(void (*)(void))slot_order, METH_FASTCALL,
     "slot_order(...) -> k, or -1 where sparse: a sorted get's order by slot (see _fast.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fast",
    "The resident get's lease bookkeeping in C (see _fast.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__fast(void)
{
    return PyModule_Create(&module);
}
