/* kvtier.coherence._gets: the first half of a get's decide in one call (coherence/gets.py),
 * and the bring-up's and install's column work (coherence/transfers.py, engine.py).
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
 *   read_installable(version u64[c], copy_ver u64[c, t], key V[c], n_rows, tier,
 *                    ok bool[m], rows i64[m], keys V[m], versions u64[m]) -> bool
 *       Whether an NVMe read's install is the usual one (round 5: the install step's checks
 *       were ~15 numpy calls, ~80 us of its ~230 on the dev VM): every record read and
 *       verified (ok), its row still inside the table, holding its key (key's items, the
 *       namespace's key width, compared bytewise) at the version read (> 0), and no copy in
 *       tier current already (nothing to share with another get's install). Writes nothing:
 *       when it says False the caller takes the general path (finish_read, install_read),
 *       which drops the bad records and shares or frees the rest; when True that path would
 *       install every copy read, which is all the caller then does.
 *   read_shares(version, copy_ver, key, n_rows, tier, ok, rows, keys, versions,
 *               out_have bool[m]) -> k
 *       read_installable's checks, but a copy current in tier already is no reason to refuse
 *       (another get's read of the same block installed first: with 4 readers of random
 *       batches, 56% of bench/stall.py's installs on the dev VM, each then ~125 us of
 *       finish_read and install_read's numpy in the service; stall10): -1 where some record
 *       is not installable as read (the caller's general path), else k, the positions whose
 *       copy is current already, marked in out_have[:m] (the caller shares those and
 *       installs the rest). Writes out_have only when it returns k >= 0.
 *   lease_current(version u64[c], key V[c], leases u16[c], rows i64[m], versions u64[m],
 *                 keys V[m], out_rows i64[m]) -> k
 *       A get's lease on its rows: out_rows[:k] = the rows[i] still at versions[i] and
 *       holding keys[i] (a row rewritten or reused since is not counted), in batch order,
 *       and leases[row] += 1 for each, a count at 65,535 staying there (the row's reader
 *       count only keeps an admin eviction off it; the slots' pins keep the bytes). A row past
 *       the columns raises ValueError before anything is written. (It raised too for a count
 *       that could pass 65,535, tested against the batch's size: every get of 65,536 keys or
 *       more that took the general path failed here, after its install, and its pins stayed
 *       for ever: rev7.)
 *
 *   plan_columns(slot i32[c, s], key V[c], copy_ver u64[c, t], nvme_checksum u64[c],
 *                nvme_off u32[c], rows i64[m], nvme_tier, out_segs i32[m], out_keys V[m],
 *                out_versions u64[m], out_sums u64[m], out_offs u32[m], out_ids i64[m]) -> k
 *       A ReadPlan's columns of rows (coherence.persist.plan_read: the record's segment, key,
 *       NVMe version, checksum and offset per row, six numpy gathers and copies before) and
 *       out_ids[:k] the distinct segment ids, ascending (np.unique's, for the log's pin). A
 *       row outside the columns or a nvme_tier past them raises ValueError before any write.
 *
 *   room_rows(version u64[c], copy_ver u64[c, t], slot i32[c, s], pool_leases u32[p],
 *             rows i64[n], n_rows, tier, out_keep i64[n]) -> (want, k)
 *       The room step's count before make_room (Gets._room_for_get, stall7: its lookup, two
 *       gathers, a comparison, a sum, a selection, a gather of slots, a cast and ufunc.at, ~50 us
 *       of the step's ~190 on the dev VM, for a few hundred nanoseconds of work): want = the
 *       positions of rows (a lookup's result, -1 where missing) whose row has a version (> 0)
 *       and no current copy in tier (copy_ver != version), the blocks the decide will bring
 *       up (a repeated key counts once a position, as the numpy count did). When want > 0 the
 *       slots of the positions whose copy in tier is current are pinned (pool_leases += 1 per
 *       occurrence) and written to out_keep[:k], for the caller's unpin after make_room; when
 *       want is 0 nothing is written and k is 0. A row at or past n_rows, or a current copy's
 *       slot outside the pool, raises ValueError before anything is written.
 *
 *   victims_covered(copy_ver u64[c, t], slot_row i64[p], victims i64[n], tier, lowers) -> bool
 *       Whether a slot tier's eviction can drop every one of the policy's victims as it is
 *       (coherence.eviction.evict_copies, stall8: an NVMe get's room step evicts 64 clean
 *       copies whose version NVMe holds, and the check was a gather of rows, two of
 *       copy_ver, a comparison and an all(), then the drop's own casts and scratch arrays,
 *       ~35 us of the dev VM's ~80 us eviction for work of a few hundred nanoseconds): True
 *       when n > 0 and each victim is a slot of slot_row holding a row inside copy_ver whose
 *       copy in tier has its version held by one of the lower tiers (lowers: a bit mask of
 *       tier indices), as eviction's _covered compares them. False for anything else,
 *       including a victim outside slot_row or a row outside the table: the caller's general
 *       path then decides (and raises) as before. Writes nothing; a tier or a lower tier
 *       past copy_ver's columns raises ValueError.
 *
 *   must_bring(version u64[c], copy_ver u64[c, t], rows i64[n], n_rows, tier) -> bool
 *       Whether any position of rows (a lookup's result, -1 where missing) has a row with a
 *       version (> 0) and no current copy in tier: try_get's refusal of a batch that must read
 *       the disk (Gets._get, io=False: an NVMe reader's get tried on the loop before its steps,
 *       stall8; eight numpy calls before, a mask, two selections, two gathers, two comparisons
 *       and an any). Writes nothing; a row at or past n_rows, or a column shorter than n_rows,
 *       raises ValueError.
 *
 *   nvme_hits(version u64[c], copy_ver u64[c, t], rows i64[n], todo i64[m], n_rows, nvme_tier,
 *             found bool[n], out_todo i64[m], out_rows i64[m]) -> k
 *       The decide's bring-up into a host tier with no HBM tier above it
 *       (Transfers._bring_up_from_nvme, stall9: a gather, two column gathers, a comparison,
 *       a count and two selections before): out_todo[:k] = the positions of todo (batch
 *       positions into rows) whose row's NVMe copy holds its version, in todo's order, and
 *       out_rows[:k] their rows; found[p] = 0 for every other position p of todo (a miss).
 *       A position past rows, or its row past n_rows, raises ValueError before any write.
 *
 *   set_copies(slot i32[c, s], copy_ver u64[c, t], slot_row i64[p], rows i64[n], tier,
 *              slots i64[n], versions u64[n]) -> None
 *       Engine.set_copy's three writes (stall9: three fancy assignments, ~18 us of a ~100 us
 *       install step on the dev VM): slot[r, tier] = slots[i], copy_ver[r, tier] = versions[i]
 *       for each i in order, then slot_row[slots[i]] = rows[i] (a repeat: the last one wins,
 *       as numpy's). A row past the columns, a slot past the pool, a tier past the columns or
 *       lengths that differ raise ValueError before any write. The policy is told by the
 *       caller.
 *
 *   install_shares(slot i32[c, s], copy_ver u64[c, t], slot_row i64[p], pool_leases u32[p],
 *                  retired bool[p], rows i64[m], tier, dst i64[m], versions u64[m],
 *                  have bool[m], pos i64[m], out_slots i64[n], out i64[3, m])
 *       -> (k_mine, k_back)
 *       Transfers.install_shared's writes (stall11: two selections, eight fancy reads and
 *       writes, set_copy, free_slots' policy notice for slots never inserted and the unpin,
 *       ~86 us of the service's install step beside 4 readers): for each record i of an NVMe
 *       read that read_shares passed, in order, where have[i] is 0 the copy read is the row's
 *       (slot[r, tier] = dst[i], copy_ver[r, tier] = versions[i], slot_row[dst[i]] = r,
 *       out_slots[pos[i]] = dst[i]; r and dst[i] to out[0] and out[1], k_mine of them, for the
 *       caller's policy notice); where have[i] is 1 the row's current copy is shared (its
 *       slot pinned, pool_leases += 1, and out_slots[pos[i]] = that slot) and dst[i] goes
 *       back as free_slots gives back a pinned slot: slot_row = -1, retired, its pin kept,
 *       and dst[i] to out[2] (k_back of them) for the caller's unpin_slots, which frees it (a
 *       fault between the two leaves it pinned for the get's give_back, never freed twice,
 *       as install_read's tail: fix9). A row past the columns, a slot (dst or shared) past
 *       the pool, a pos past out_slots, a dst going back without a pin, a tier past the
 *       columns or lengths that differ raise ValueError before any write. Rows are distinct
 *       (a read plan's), and so are the dst slots.
 *
 *   touch_rows(last_access u64[c], prev_access u64[c], freq u32[c], rows i64[n], clock)
 *       -> None
 *       Engine.touch's writes (stall9: three fancy writes and an arange, ~15 us of the install
 *       step): as numpy does them, prev_access[r] = last_access[r] from before the batch,
 *       last_access[r] = clock + 1 + (r's last position), freq[r] += 1 once per distinct row
 *       (freq wraps at 2^32, as numpy's). The caller advances its clock by n. A row past the
 *       columns raises ValueError before any write.
 *
 * No reference to any argument is kept. The GIL is held (under the engine lock; microseconds).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>

#include "cviews.h"

/* The item size of a 1-D key array (a page table's V<key width> column), without a view:
 * view() checks the size it is told. 0 on error. */
static int key_width_of(PyObject *obj, Py_ssize_t *width, const char *name)
{
    Py_buffer b;
    if (PyObject_GetBuffer(obj, &b, PyBUF_ND) < 0)
        return 0;
    *width = b.itemsize;
    int fine = b.ndim == 1 && b.itemsize >= 1 && b.itemsize <= 64;
    PyBuffer_Release(&b);
    if (!fine)
        PyErr_Format(PyExc_TypeError, "%s: expected a 1-D array of keys (1 to 64 bytes each)",
                     name);
    return fine;
}

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

/* read_installable (shares 0) and read_shares (shares 1): the same checks; read_shares takes
 * a copy current in the tier already as no reason to refuse, and marks it in out_have. */
static PyObject *install_verdict(PyObject *const *args, Py_ssize_t nargs, int shares,
                                 const char *name)
{
    if (nargs != 9 + shares) {
        PyErr_Format(PyExc_TypeError, "%s takes %d arguments", name, 9 + shares);
        return NULL;
    }
    Views v = {.n = 0};
    Py_ssize_t cap[3], nt, n_rows, tier, m[5], kw;
    PyObject *result = NULL;
    if (!key_width_of(args[2], &kw, "key") || !key_width_of(args[7], &m[3], "keys"))
        return NULL;
    if (m[3] != kw) {
        PyErr_Format(PyExc_ValueError, "%s: keys of another width", name);
        return NULL;
    }
    uint64_t *version = view(&v, args[0], 8, 0, &cap[0], NULL, "version");
    uint64_t *copy_ver = version ? view(&v, args[1], 8, 0, &cap[1], &nt, "copy_ver") : NULL;
    uint8_t *key = copy_ver ? view(&v, args[2], kw, 0, &cap[2], NULL, "key") : NULL;
    uint8_t *ok = key ? view(&v, args[5], 1, 0, &m[0], NULL, "ok") : NULL;
    int64_t *rows = ok ? view(&v, args[6], 8, 0, &m[1], NULL, "rows") : NULL;
    uint8_t *keys = rows ? view(&v, args[7], kw, 0, &m[2], NULL, "keys") : NULL;
    uint64_t *vers = keys ? view(&v, args[8], 8, 0, &m[3], NULL, "versions") : NULL;
    uint8_t *have = NULL;
    if (vers != NULL && shares) {
        have = view(&v, args[9], 1, 1, &m[4], NULL, "out_have");
        if (have == NULL)
            vers = NULL;
    }
    if (vers == NULL || as_index(args[3], &n_rows, "n_rows") < 0
            || as_index(args[4], &tier, "tier") < 0)
        goto done;
    if (cap[0] < n_rows || cap[1] < n_rows || cap[2] < n_rows || tier >= nt) {
        PyErr_Format(PyExc_ValueError, "%s: a column is shorter than n_rows, or tier is past "
                     "them", name);
        goto done;
    }
    if (m[0] != m[1] || m[2] != m[1] || m[3] != m[1] || (shares && m[4] < m[1])) {
        PyErr_Format(PyExc_ValueError, "%s: ok, rows, keys and versions differ in length%s",
                     name, shares ? ", or out_have is shorter" : "");
        goto done;
    }
    int usual = 1;
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < m[1] && usual; i++) {
        int64_t r = rows[i];
        usual = ok[i] && r >= 0 && r < n_rows && version[r] && version[r] == vers[i]
                && memcmp(key + r * kw, keys + i * kw, (size_t)kw) == 0;
        if (usual && copy_ver[r * nt + tier] == version[r]) {
            usual = shares;
            k++;
        }
    }
    if (!shares) {
        result = PyBool_FromLong(usual);
        goto done;
    }
    if (usual)                  /* written only once every record is known installable */
        for (Py_ssize_t i = 0; i < m[1]; i++)
            have[i] = copy_ver[rows[i] * nt + tier] == version[rows[i]];
    result = PyLong_FromSsize_t(usual ? k : -1);
done:
    views_release(&v);
    return result;
}

static PyObject *read_installable(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    return install_verdict(args, nargs, 0, "read_installable");
}

static PyObject *read_shares(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    return install_verdict(args, nargs, 1, "read_shares");
}

static PyObject *lease_current(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "lease_current takes 7 arguments");
        return NULL;
    }
    Views v = {.n = 0};
    Py_ssize_t cap[3], m[4], kw, kw2;
    PyObject *result = NULL;
    if (!key_width_of(args[1], &kw, "key") || !key_width_of(args[5], &kw2, "keys"))
        return NULL;
    if (kw2 != kw) {
        PyErr_SetString(PyExc_ValueError, "lease_current: keys of another width");
        return NULL;
    }
    uint64_t *version = view(&v, args[0], 8, 0, &cap[0], NULL, "version");
    uint8_t *key = version ? view(&v, args[1], kw, 0, &cap[1], NULL, "key") : NULL;
    uint16_t *leases = key ? view(&v, args[2], 2, 1, &cap[2], NULL, "leases") : NULL;
    int64_t *rows = leases ? view(&v, args[3], 8, 0, &m[0], NULL, "rows") : NULL;
    uint64_t *vers = rows ? view(&v, args[4], 8, 0, &m[1], NULL, "versions") : NULL;
    uint8_t *keys = vers ? view(&v, args[5], kw, 0, &m[2], NULL, "keys") : NULL;
    int64_t *out = keys ? view(&v, args[6], 8, 1, &m[3], NULL, "out_rows") : NULL;
    if (out == NULL)
        goto done;
    Py_ssize_t n = m[0], c = cap[0] < cap[1] ? cap[0] : cap[1];
    if (c > cap[2])
        c = cap[2];
    if (m[1] != n || m[2] != n || m[3] < n) {
        PyErr_SetString(PyExc_ValueError, "lease_current: rows, versions, keys and out_rows "
                        "differ in length");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= c) {
            PyErr_SetString(PyExc_ValueError, "lease_current: a row past the columns");
            goto done;
        }
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        if (version[r] == vers[i] && memcmp(key + r * kw, keys + i * kw, (size_t)kw) == 0) {
            if (leases[r] < UINT16_MAX)       /* saturates: see the contract above */
                leases[r] += 1;
            out[k++] = r;
        }
    }
    result = PyLong_FromSsize_t(k);
done:
    views_release(&v);
    return result;
}

static int cmp_i32(const void *a, const void *b)
{
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return x < y ? -1 : x > y;
}

static PyObject *plan_columns(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 13) {
        PyErr_SetString(PyExc_TypeError, "plan_columns takes 13 arguments");
        return NULL;
    }
    Views v = {.n = 0};
    Py_ssize_t cap[5], ns, nt, m[7], kw, kw2, tier;
    PyObject *result = NULL;
    int32_t *sorted = NULL;
    if (!key_width_of(args[1], &kw, "key") || !key_width_of(args[8], &kw2, "out_keys"))
        return NULL;
    if (kw2 != kw) {
        PyErr_SetString(PyExc_ValueError, "plan_columns: keys of another width");
        return NULL;
    }
    int32_t *slot = view(&v, args[0], 4, 0, &cap[0], &ns, "slot");
    uint8_t *key = slot ? view(&v, args[1], kw, 0, &cap[1], NULL, "key") : NULL;
    uint64_t *copy_ver = key ? view(&v, args[2], 8, 0, &cap[2], &nt, "copy_ver") : NULL;
    uint64_t *csum = copy_ver ? view(&v, args[3], 8, 0, &cap[3], NULL, "nvme_checksum") : NULL;
    uint32_t *off = csum ? view(&v, args[4], 4, 0, &cap[4], NULL, "nvme_off") : NULL;
    int64_t *rows = off ? view(&v, args[5], 8, 0, &m[0], NULL, "rows") : NULL;
    int32_t *o_seg = rows ? view(&v, args[7], 4, 1, &m[1], NULL, "out_segs") : NULL;
    uint8_t *o_key = o_seg ? view(&v, args[8], kw, 1, &m[2], NULL, "out_keys") : NULL;
    uint64_t *o_ver = o_key ? view(&v, args[9], 8, 1, &m[3], NULL, "out_versions") : NULL;
    uint64_t *o_sum = o_ver ? view(&v, args[10], 8, 1, &m[4], NULL, "out_sums") : NULL;
    uint32_t *o_off = o_sum ? view(&v, args[11], 4, 1, &m[5], NULL, "out_offs") : NULL;
    int64_t *o_ids = o_off ? view(&v, args[12], 8, 1, &m[6], NULL, "out_ids") : NULL;
    if (o_ids == NULL || as_index(args[6], &tier, "nvme_tier") < 0)
        goto done;
    Py_ssize_t n = m[0], c = cap[0];
    for (int i = 1; i < 5; i++)
        if (cap[i] < c)
            c = cap[i];
    for (int i = 1; i < 7; i++)
        if (m[i] != n) {
            PyErr_SetString(PyExc_ValueError, "plan_columns: an output differs from rows in "
                            "length");
            goto done;
        }
    if (tier >= ns || tier >= nt) {
        PyErr_SetString(PyExc_ValueError, "plan_columns: nvme_tier past the columns");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= c) {
            PyErr_SetString(PyExc_ValueError, "plan_columns: a row outside the columns");
            goto done;
        }
    sorted = malloc((size_t)(n ? n : 1) * sizeof *sorted);
    if (sorted == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        o_seg[i] = sorted[i] = slot[r * ns + tier];
        memcpy(o_key + i * kw, key + r * kw, (size_t)kw);
        o_ver[i] = copy_ver[r * nt + tier];
        o_sum[i] = csum[r];
        o_off[i] = off[r];
    }
    qsort(sorted, (size_t)n, sizeof *sorted, cmp_i32);
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (k == 0 || sorted[i] != o_ids[k - 1])
            o_ids[k++] = sorted[i];
    result = PyLong_FromSsize_t(k);
done:
    free(sorted);
    views_release(&v);
    return result;
}

static PyObject *room_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "room_rows takes 8 arguments");
        return NULL;
    }
    Views v = {.n = 0};
    Py_ssize_t cap[3], nt, ns, np_, n, n_keep, n_rows, tier;
    uint64_t *version = view(&v, args[0], 8, 0, &cap[0], NULL, "version");
    uint64_t *copy_ver = version ? view(&v, args[1], 8, 0, &cap[1], &nt, "copy_ver") : NULL;
    int32_t *slot = copy_ver ? view(&v, args[2], 4, 0, &cap[2], &ns, "slot") : NULL;
    uint32_t *pool = slot ? view(&v, args[3], 4, 1, &np_, NULL, "pool_leases") : NULL;
    int64_t *rows = pool ? view(&v, args[4], 8, 0, &n, NULL, "rows") : NULL;
    int64_t *keep = rows ? view(&v, args[7], 8, 1, &n_keep, NULL, "out_keep") : NULL;
    PyObject *result = NULL;
    if (keep == NULL || as_index(args[5], &n_rows, "n_rows") < 0
            || as_index(args[6], &tier, "tier") < 0)
        goto done;
    for (int i = 0; i < 3; i++)
        if (cap[i] < n_rows) {
            PyErr_SetString(PyExc_ValueError, "room_rows: a column is shorter than n_rows");
            goto done;
        }
    if (n_keep < n) {
        PyErr_SetString(PyExc_ValueError, "room_rows: out_keep is shorter than rows");
        goto done;
    }
    if (tier >= nt || tier >= ns) {
        PyErr_SetString(PyExc_ValueError, "room_rows: tier past the columns");
        goto done;
    }
    /* Check and count before writing anything. */
    Py_ssize_t want = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        if (r >= n_rows) {
            PyErr_SetString(PyExc_ValueError, "room_rows: a row past the table");
            goto done;
        }
        if (r < 0 || version[r] == 0)
            continue;
        if (copy_ver[r * nt + tier] != version[r]) {
            want++;
            continue;
        }
        int32_t s = slot[r * ns + tier];
        if (s < 0 || s >= np_) {
            PyErr_SetString(PyExc_ValueError, "room_rows: a current copy's slot is outside "
                            "the pool");
            goto done;
        }
    }
    Py_ssize_t k = 0;
    if (want)
        for (Py_ssize_t i = 0; i < n; i++) {
            int64_t r = rows[i];
            if (r >= 0 && version[r] && copy_ver[r * nt + tier] == version[r]) {
                int32_t s = slot[r * ns + tier];
                pool[s] += 1;
                keep[k++] = s;
            }
        }
    result = Py_BuildValue("(nn)", want, k);
done:
    views_release(&v);
    return result;
}

static PyObject *victims_covered(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "victims_covered takes 5 arguments");
        return NULL;
    }
    Views v = {.n = 0};
    Py_ssize_t n_rows, nt, n_slots, n, tier;
    uint64_t *copy_ver = view(&v, args[0], 8, 0, &n_rows, &nt, "copy_ver");
    int64_t *slot_row = copy_ver ? view(&v, args[1], 8, 0, &n_slots, NULL, "slot_row") : NULL;
    int64_t *victims = slot_row ? view(&v, args[2], 8, 0, &n, NULL, "victims") : NULL;
    PyObject *result = NULL;
    if (victims == NULL || as_index(args[3], &tier, "tier") < 0)
        goto done;
    unsigned long long lowers = PyLong_AsUnsignedLongLong(args[4]);
    if (lowers == (unsigned long long)-1 && PyErr_Occurred())
        goto done;
    if (tier >= nt || (nt < 64 && (lowers >> nt) != 0)) {
        PyErr_SetString(PyExc_ValueError, "victims_covered: a tier past copy_ver's columns");
        goto done;
    }
    int covered = n > 0;
    for (Py_ssize_t i = 0; covered && i < n; i++) {
        int64_t s = victims[i];
        int64_t r = s >= 0 && s < n_slots ? slot_row[s] : -1;
        if (r < 0 || r >= n_rows) {
            covered = 0;
            break;
        }
        const uint64_t *cv = copy_ver + r * nt;
        int any = 0;
        for (Py_ssize_t t = 0; t < nt && t < 64 && !any; t++)   /* lowers names 64 tiers */
            any = ((lowers >> t) & 1) && cv[t] == cv[tier];
        covered = any;
    }
    result = PyBool_FromLong(covered);
done:
    views_release(&v);
    return result;
}

static PyObject *must_bring(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "must_bring takes 5 arguments");
        return NULL;
    }
    Views v = {.n = 0};
    Py_ssize_t cap[2], nt, n, n_rows, tier;
    uint64_t *version = view(&v, args[0], 8, 0, &cap[0], NULL, "version");
    uint64_t *copy_ver = version ? view(&v, args[1], 8, 0, &cap[1], &nt, "copy_ver") : NULL;
    int64_t *rows = copy_ver ? view(&v, args[2], 8, 0, &n, NULL, "rows") : NULL;
    PyObject *result = NULL;
    if (rows == NULL || as_index(args[3], &n_rows, "n_rows") < 0
            || as_index(args[4], &tier, "tier") < 0)
        goto done;
    if (cap[0] < n_rows || cap[1] < n_rows) {
        PyErr_SetString(PyExc_ValueError, "must_bring: a column is shorter than n_rows");
        goto done;
    }
    if (tier >= nt) {
        PyErr_SetString(PyExc_ValueError, "must_bring: tier past the columns");
        goto done;
    }
    int bring = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        if (r >= n_rows) {
            PyErr_SetString(PyExc_ValueError, "must_bring: a row past the table");
            goto done;
        }
        if (r >= 0 && version[r] && copy_ver[r * nt + tier] != version[r])
            bring = 1;              /* (every row is still checked against the table) */
    }
    result = PyBool_FromLong(bring);
done:
    views_release(&v);
    return result;
}

/* ---------------------------------------------------------------- the bring-up and install
 * (coherence/transfers.py, coherence/engine.py: stall9) */

static PyObject *nvme_hits(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "nvme_hits takes 9 arguments");
        return NULL;
    }
    Views v = {.n = 0};
    Py_ssize_t cap[2], nt, n, m, n_found, n_out[2], n_rows, nvme;
    uint64_t *version = view(&v, args[0], 8, 0, &cap[0], NULL, "version");
    uint64_t *copy_ver = version ? view(&v, args[1], 8, 0, &cap[1], &nt, "copy_ver") : NULL;
    int64_t *rows = copy_ver ? view(&v, args[2], 8, 0, &n, NULL, "rows") : NULL;
    int64_t *todo = rows ? view(&v, args[3], 8, 0, &m, NULL, "todo") : NULL;
    uint8_t *found = todo ? view(&v, args[6], 1, 1, &n_found, NULL, "found") : NULL;
    int64_t *o_todo = found ? view(&v, args[7], 8, 1, &n_out[0], NULL, "out_todo") : NULL;
    int64_t *o_rows = o_todo ? view(&v, args[8], 8, 1, &n_out[1], NULL, "out_rows") : NULL;
    PyObject *result = NULL;
    if (o_rows == NULL || as_index(args[4], &n_rows, "n_rows") < 0
            || as_index(args[5], &nvme, "nvme_tier") < 0)
        goto done;
    if (cap[0] < n_rows || cap[1] < n_rows || nvme >= nt) {
        PyErr_SetString(PyExc_ValueError, "nvme_hits: a column is shorter than n_rows, or "
                        "nvme_tier is past them");
        goto done;
    }
    if (n_found < n || n_out[0] < m || n_out[1] < m) {
        PyErr_SetString(PyExc_ValueError, "nvme_hits: found is shorter than rows, or an "
                        "output shorter than todo");
        goto done;
    }
    /* Check everything before writing anything. */
    for (Py_ssize_t i = 0; i < m; i++) {
        int64_t p = todo[i];
        if (p < 0 || p >= n || rows[p] < 0 || rows[p] >= n_rows) {
            PyErr_SetString(PyExc_ValueError, "nvme_hits: a position past rows, or its row "
                            "past the table");
            goto done;
        }
    }
    Py_ssize_t k = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        int64_t p = todo[i], r = rows[p];
        if (copy_ver[r * nt + nvme] == version[r]) {
            o_todo[k] = p;
            o_rows[k++] = r;
        } else {
            found[p] = 0;
        }
    }
    result = PyLong_FromSsize_t(k);
done:
    views_release(&v);
    return result;
}

static PyObject *set_copies(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "set_copies takes 7 arguments");
        return NULL;
    }
    Views v = {.n = 0};
    Py_ssize_t cap[2], nsl, nt, np_, n[3], tier;
    int32_t *slot = view(&v, args[0], 4, 1, &cap[0], &nsl, "slot");
    uint64_t *copy_ver = slot ? view(&v, args[1], 8, 1, &cap[1], &nt, "copy_ver") : NULL;
    int64_t *slot_row = copy_ver ? view(&v, args[2], 8, 1, &np_, NULL, "slot_row") : NULL;
    int64_t *rows = slot_row ? view(&v, args[3], 8, 0, &n[0], NULL, "rows") : NULL;
    int64_t *slots = rows ? view(&v, args[5], 8, 0, &n[1], NULL, "slots") : NULL;
    uint64_t *vers = slots ? view(&v, args[6], 8, 0, &n[2], NULL, "versions") : NULL;
    PyObject *result = NULL;
    if (vers == NULL || as_index(args[4], &tier, "tier") < 0)
        goto done;
    if (tier >= nsl || tier >= nt) {
        PyErr_SetString(PyExc_ValueError, "set_copies: tier past the columns");
        goto done;
    }
    if (n[1] != n[0] || n[2] != n[0]) {
        PyErr_SetString(PyExc_ValueError, "set_copies: rows, slots and versions differ in "
                        "length");
        goto done;
    }
    Py_ssize_t c = cap[0] < cap[1] ? cap[0] : cap[1];
    /* Check everything before writing anything. */
    for (Py_ssize_t i = 0; i < n[0]; i++)
        if (rows[i] < 0 || rows[i] >= c || slots[i] < 0 || slots[i] >= np_
                || slots[i] > INT32_MAX) {
            PyErr_SetString(PyExc_ValueError, "set_copies: a row past the columns, or a slot "
                            "past the pool");
            goto done;
        }
    for (Py_ssize_t i = 0; i < n[0]; i++) {
        int64_t r = rows[i];
        slot[r * nsl + tier] = (int32_t)slots[i];
        copy_ver[r * nt + tier] = vers[i];
    }
    for (Py_ssize_t i = 0; i < n[0]; i++)
        slot_row[slots[i]] = rows[i];
    result = Py_NewRef(Py_None);
done:
    views_release(&v);
    return result;
}

static PyObject *install_shares(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 13) {
        PyErr_SetString(PyExc_TypeError, "install_shares takes 13 arguments");
        return NULL;
    }
    Views v = {.n = 0};
    Py_ssize_t cap[2], nsl, nt, np_[3], m[5], n_out, out_len, out_w, tier;
    int32_t *slot = view(&v, args[0], 4, 1, &cap[0], &nsl, "slot");
    uint64_t *copy_ver = slot ? view(&v, args[1], 8, 1, &cap[1], &nt, "copy_ver") : NULL;
    int64_t *slot_row = copy_ver ? view(&v, args[2], 8, 1, &np_[0], NULL, "slot_row") : NULL;
    uint32_t *leases = slot_row ? view(&v, args[3], 4, 1, &np_[1], NULL, "pool_leases")
                                : NULL;
    uint8_t *retired = leases ? view(&v, args[4], 1, 1, &np_[2], NULL, "retired") : NULL;
    int64_t *rows = retired ? view(&v, args[5], 8, 0, &m[0], NULL, "rows") : NULL;
    int64_t *dst = rows ? view(&v, args[7], 8, 0, &m[1], NULL, "dst") : NULL;
    uint64_t *vers = dst ? view(&v, args[8], 8, 0, &m[2], NULL, "versions") : NULL;
    uint8_t *have = vers ? view(&v, args[9], 1, 0, &m[3], NULL, "have") : NULL;
    int64_t *pos = have ? view(&v, args[10], 8, 0, &m[4], NULL, "pos") : NULL;
    int64_t *out_slots = pos ? view(&v, args[11], 8, 1, &n_out, NULL, "out_slots") : NULL;
    int64_t *out = out_slots ? view(&v, args[12], 8, 1, &out_len, &out_w, "out") : NULL;
    PyObject *result = NULL;
    if (out == NULL || as_index(args[6], &tier, "tier") < 0)
        goto done;
    Py_ssize_t n = m[0], c = cap[0] < cap[1] ? cap[0] : cap[1], p = np_[0];
    if (tier >= nsl || tier >= nt || np_[1] != p || np_[2] != p) {
        PyErr_SetString(PyExc_ValueError, "install_shares: tier past the columns, or the "
                        "pool's arrays differ in length");
        goto done;
    }
    if (m[1] != n || m[2] != n || m[3] != n || m[4] != n || out_len != 3 || out_w < n) {
        PyErr_SetString(PyExc_ValueError, "install_shares: rows, dst, versions, have and pos "
                        "differ in length, or out is not 3 rows of at least that many");
        goto done;
    }
    /* Check everything before writing anything. */
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = rows[i], d = dst[i];
        int bad = r < 0 || r >= c || d < 0 || d >= p || d > INT32_MAX || pos[i] < 0
                  || pos[i] >= n_out;
        if (!bad && have[i]) {
            int64_t theirs = slot[r * nsl + tier];
            bad = theirs < 0 || theirs >= p || leases[theirs] == UINT32_MAX || leases[d] == 0;
        }
        if (bad) {
            PyErr_SetString(PyExc_ValueError, "install_shares: a row past the columns, a slot "
                            "past the pool, a position past out_slots, or a slot going back "
                            "without a pin");
            goto done;
        }
    }
    int64_t *mine_rows = out, *mine_slots = out + out_w, *back = out + 2 * out_w;
    Py_ssize_t k_mine = 0, k_back = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = rows[i], d = dst[i];
        if (!have[i]) {
            slot[r * nsl + tier] = (int32_t)d;
            copy_ver[r * nt + tier] = vers[i];
            slot_row[d] = r;
            out_slots[pos[i]] = d;
            mine_rows[k_mine] = r;
            mine_slots[k_mine++] = d;
            continue;
        }
        int64_t theirs = slot[r * nsl + tier];
        leases[theirs] += 1;
        out_slots[pos[i]] = theirs;
        slot_row[d] = -1;       /* retired while pinned: the caller's unpin frees it */
        retired[d] = 1;
        back[k_back++] = d;
    }
    result = Py_BuildValue("(nn)", k_mine, k_back);
done:
    views_release(&v);
    return result;
}

static PyObject *touch_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "touch_rows takes 5 arguments");
        return NULL;
    }
    Views v = {.n = 0};
    Py_ssize_t cap[3], n;
    uint64_t *last = view(&v, args[0], 8, 1, &cap[0], NULL, "last_access");
    uint64_t *prev = last ? view(&v, args[1], 8, 1, &cap[1], NULL, "prev_access") : NULL;
    uint32_t *freq = prev ? view(&v, args[2], 4, 1, &cap[2], NULL, "freq") : NULL;
    int64_t *rows = freq ? view(&v, args[3], 8, 0, &n, NULL, "rows") : NULL;
    PyObject *result = NULL;
    if (rows == NULL)
        goto done;
    unsigned long long clock = PyLong_AsUnsignedLongLong(args[4]);
    if (clock == (unsigned long long)-1 && PyErr_Occurred())
        goto done;
    Py_ssize_t c = cap[0] < cap[1] ? cap[0] : cap[1];
    if (c > cap[2])
        c = cap[2];
    for (Py_ssize_t i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= c) {
            PyErr_SetString(PyExc_ValueError, "touch_rows: a row past the columns");
            goto done;
        }
    /* As numpy's three fancy writes: prev_access from last_access before the batch (every
     * row first), last_access the last occurrence's stamp, freq once per distinct row (while
     * last == prev, r was not yet seen here: _fast.lease_rows' test). */
    for (Py_ssize_t i = 0; i < n; i++)
        prev[rows[i]] = last[rows[i]];
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t r = rows[i];
        if (last[r] == prev[r])
            freq[r] += 1;
        last[r] = clock + (uint64_t)i + 1;
    }
    result = Py_NewRef(Py_None);
done:
    views_release(&v);
    return result;
}

static PyMethodDef methods[] = {
    {"split_rows", (PyCFunction)(void (*)(void))split_rows, METH_FASTCALL,
     "split_rows(...): a get's batch split into found, ready (pinned) and to bring up."},
    {"read_installable", (PyCFunction)(void (*)(void))read_installable, METH_FASTCALL,
     "read_installable(...): whether every record of an NVMe read installs as it is."},
    {"read_shares", (PyCFunction)(void (*)(void))read_shares, METH_FASTCALL,
     "read_shares(...): read_installable, a copy current already marked, not refused."},
    {"lease_current", (PyCFunction)(void (*)(void))lease_current, METH_FASTCALL,
     "lease_current(...): a get's lease on the rows still at the versions served."},
    {"plan_columns", (PyCFunction)(void (*)(void))plan_columns, METH_FASTCALL,
     "plan_columns(...): an NVMe read plan's columns and its distinct segments."},
    {"room_rows", (PyCFunction)(void (*)(void))room_rows, METH_FASTCALL,
     "room_rows(...): the room step's count of blocks to bring up, and its pins."},
    {"victims_covered", (PyCFunction)(void (*)(void))victims_covered, METH_FASTCALL,
     "victims_covered(...): whether a lower tier holds every victim's version."},
    {"must_bring", (PyCFunction)(void (*)(void))must_bring, METH_FASTCALL,
     "must_bring(...): whether a batch has a block to bring up into the tier."},
    {"nvme_hits", (PyCFunction)(void (*)(void))nvme_hits, METH_FASTCALL,
     "nvme_hits(...): the bring-up positions whose row NVMe holds at its version."},
    {"set_copies", (PyCFunction)(void (*)(void))set_copies, METH_FASTCALL,
     "set_copies(...): rows' copies placed in slots of a tier (slot, copy_ver, slot_row)."},
    {"install_shares", (PyCFunction)(void (*)(void))install_shares, METH_FASTCALL,
     "install_shares(...): an NVMe read installed, the copies others installed shared."},
    {"touch_rows", (PyCFunction)(void (*)(void))touch_rows, METH_FASTCALL,
     "touch_rows(...): an access of rows in batch order (prev, last, freq)."},
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
