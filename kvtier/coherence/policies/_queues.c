/* kvtier.coherence.policies._queues: the slot tiers' eviction queues (policies.queues) and the
 * ghost of evicted keys (policies.rings.Ghost) in C.
 *
 * Why. After the page table's and the commit's loops went to C (issue 18, rounds 2 and 3), the
 * policies' queue maintenance was half of chain's replay CPU and a fifth of lru's: each of
 * S3Fifo.on_insert, on_remove and victims was 15-25 numpy calls on a batch of ~25 slots, a
 * microsecond or more each on the dev VM, for work of a few hundred nanoseconds. Each of them is
 * one call here. queues.py and rings.py keep the numpy versions as the reference and the
 * fallback where this module was not built; tests/test_policies.py and tests/test_engine.py run
 * both on the same workloads and compare the state they leave.
 *
 * The state is the policy object's numpy arrays (no reference is kept between calls):
 *   per    i64[p, c]  per slot: the stamp of its current entry, then (S3Fifo) the freq column
 *                     when last looked at and the main queue's aging counter
 *   where  i8[p]      NONE (-1), the queue it is in, or PENDING + queue once handed out
 *   st     i64[12]    next stamp, the two queues' counts, ghost hits, each ring's head and
 *                     length, the probation target, freq_max, leaf_first, the compaction
 *                     threshold (queues.py names them ST_*)
 *   ring0, ring1 i64[cap, 2]  the probation and main FIFOs of (slot, stamp), power-of-two cap;
 *                     the caller makes room before a call (Ring.reserve), and a call that would
 *                     still overflow raises before it writes past a ring
 *   ghost: fp u32[sets, 4], seq i64[sets, 4], alive bool[a], gst i64[4] (head, tail, live, size)
 *
 *   s3_insert(per, where, st, ring0, ring1, fp, seq, alive, gst, keycol, width, freq, rows,
 *             slots, rep i64[k, 3])                      S3Fifo.on_insert
 *   s3_remove(per, where, st, fp, seq, alive, gst, slot_row, keycol, width, slots,
 *             out_rep i64[n, 3]) -> k, or -1             S3Fifo.on_remove
 *   s3_victims(per, where, st, ring0, ring1, slot_row, freq, leases, n, out i64[n]
 *              [, fp, seq, alive, gst, keycol, width]) -> k
 *   s3_give_back(per, where, st, ring0, ring1, slots)
 *   lru_insert(per, where, st, rows, slots, last_access, out_stamps) -> epoch, or -1
 *   lru_take(per, where, cur i64[m, 3], pos, need, slot_row, last_access, leases, out i64[need],
 *            scratch i64[s, 3][, drop]) -> (pos, taken, n_moved, n_held)
 *   ghost_add(fp, seq, alive, gst, hashes), ghost_take(fp, seq, alive, gst, hashes, out_found)
 * Each function's comment says which Python method it is; the numpy version is the spec.
 * The GIL is held: these run under the engine lock, on batches that take microseconds.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../cviews.h"
#include "../../pagetable/keyhash.h"
#include "ghost.h"

#define NONE (-1)
#define PENDING 8
#define SMALL 0
#define MAIN 1
#define EPOCH_SHIFT 10

enum { ST_NEXT, ST_COUNT0, ST_COUNT1, ST_GHOST_HITS, ST_HEAD0, ST_LEN0, ST_HEAD1, ST_LEN1,
       ST_SMALL_TARGET, ST_FREQ_MAX, ST_LEAF_FIRST, ST_COMPACT_AT, ST_SIZE };

static PyObject *ghost_add(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Views v = {.n = 0};
    Ghost g;
    Py_ssize_t n;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "ghost_add takes 5 arguments");
        return NULL;
    }
    const uint64_t *hashes = ghost_views(&v, args, &g, "ghost_add") < 0 ? NULL
        : view(&v, args[4], 8, 0, &n, NULL, "ghost_add");
    if (hashes)
        ghost_put(&g, hashes, n);
    views_release(&v);
    if (!hashes)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *ghost_take(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Views v = {.n = 0};
    Ghost g;
    Py_ssize_t n, m;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "ghost_take takes 6 arguments");
        return NULL;
    }
    const uint64_t *hashes = ghost_views(&v, args, &g, "ghost_take") < 0 ? NULL
        : view(&v, args[4], 8, 0, &n, NULL, "ghost_take");
    uint8_t *out = hashes ? view(&v, args[5], 1, 1, &m, NULL, "ghost_take") : NULL;
    if (!out || m != n) {
        if (out)
            PyErr_SetString(PyExc_ValueError, "ghost_take: one output per key");
        views_release(&v);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        out[i] = (uint8_t)ghost_pull(&g, hashes[i]);
    views_release(&v);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- a policy's arrays */

typedef struct {
    int64_t *per;                /* per slot: stamp, then base and cnt (S3Fifo) */
    Py_ssize_t ncol;
    int8_t *where;
    Py_ssize_t n_slots;
    int64_t *st;
    int64_t *ring[2];            /* (slot, stamp) pairs */
    int64_t cap[2];
} Pol;

#define STAMP(p, s) ((p)->per[(s) * (p)->ncol])
#define BASE(p, s) ((p)->per[(s) * (p)->ncol + 1])
#define CNT(p, s) ((p)->per[(s) * (p)->ncol + 2])
#define RHEAD(p, q) ((p)->st[ST_HEAD0 + 2 * (q)])
#define RLEN(p, q) ((p)->st[ST_LEN0 + 2 * (q)])

/* per, where, st from args[0..2]; with rings, ring0 and ring1 from args[3..4]. */
static int pol_views(Views *v, PyObject *const *args, Pol *p, int ncol, int rings,
                     const char *name)
{
    Py_ssize_t n, c, nw, ns;
    p->per = view(v, args[0], 8, 1, &n, &c, name);
    p->where = p->per ? view(v, args[1], 1, 1, &nw, NULL, name) : NULL;
    p->st = p->where ? view(v, args[2], 8, 1, &ns, NULL, name) : NULL;
    if (!p->st)
        return -1;
    if (c < ncol || nw != n || ns != ST_SIZE) {
        PyErr_Format(PyExc_ValueError, "%s: not a policy's arrays (see _queues.c)", name);
        return -1;
    }
    p->ncol = c;
    p->n_slots = n;
    for (int q = 0; rings && q < 2; q++) {
        Py_ssize_t cap, two;
        p->ring[q] = view(v, args[3 + q], 8, 1, &cap, &two, name);
        if (!p->ring[q])
            return -1;
        if (two != 2 || cap == 0 || (cap & (cap - 1)) || RLEN(p, q) < 0 || RLEN(p, q) > cap
                || RHEAD(p, q) < 0 || RHEAD(p, q) >= cap) {
            PyErr_Format(PyExc_ValueError, "%s: not a ring's arrays (see _queues.c)", name);
            return -1;
        }
        p->cap[q] = cap;
    }
    return 0;
}

static int slots_ok(const Pol *p, const int64_t *slots, Py_ssize_t n, const char *name)
{
    for (Py_ssize_t i = 0; i < n; i++)
        if (slots[i] < 0 || slots[i] >= p->n_slots) {
            PyErr_Format(PyExc_ValueError, "%s: a slot past the tier", name);
            return -1;
        }
    return 0;
}

static inline int valid(const Pol *p, int64_t s, int64_t stamp, int q)
{
    return s >= 0 && s < p->n_slots && STAMP(p, s) == stamp && p->where[s] == q;
}

/* Ring.compact: the entries of ring q that are no longer current go, order kept. */
static void ring_compact(Pol *p, int q)
{
    int64_t mask = p->cap[q] - 1, head = RHEAD(p, q), n = RLEN(p, q), k = 0;
    int64_t *r = p->ring[q];
    for (int64_t i = 0; i < n; i++) {
        int64_t at = (head + i) & mask;
        if (valid(p, r[2 * at], r[2 * at + 1], q)) {
            int64_t to = (head + k++) & mask;
            r[2 * to] = r[2 * at];
            r[2 * to + 1] = r[2 * at + 1];
        }
    }
    RLEN(p, q) = k;
}

static int ring_room(Pol *p, int q, int64_t extra)
{
    if (RLEN(p, q) + extra > p->cap[q]) {
        PyErr_SetString(PyExc_RuntimeError, "a policy ring is full: Ring.reserve was not called "
                        "for this batch (a bug in policies.queues)");
        return -1;
    }
    return 0;
}

static inline void ring_put(Pol *p, int q, int64_t at_index, int64_t s, int64_t stamp)
{
    int64_t at = at_index & (p->cap[q] - 1);
    p->ring[q][2 * at] = s;
    p->ring[q][2 * at + 1] = stamp;
}

/* S3Fifo._push of k slots (their stamps from per) at the tail of q, or at its head in order
 * (front); then the ring is compacted when it holds more than the threshold. */
static int push(Pol *p, int q, const int64_t *slots, Py_ssize_t k, int front)
{
    if (k == 0)
        return 0;
    if (ring_room(p, q, k) < 0)
        return -1;
    if (front)
        RHEAD(p, q) = (RHEAD(p, q) - k) & (p->cap[q] - 1);
    int64_t base = front ? RHEAD(p, q) : RHEAD(p, q) + RLEN(p, q);
    for (Py_ssize_t i = 0; i < k; i++) {
        p->where[slots[i]] = (int8_t)q;
        ring_put(p, q, base + i, slots[i], STAMP(p, slots[i]));
    }
    RLEN(p, q) += k;
    p->st[ST_COUNT0 + q] += k;
    if (RLEN(p, q) > p->st[ST_COMPACT_AT])
        ring_compact(p, q);
    return 0;
}

/* ---------------------------------------------------------------- S3Fifo */

/* S3Fifo.on_insert(rows, slots): rows' copies now in slots (batch order; deepest first with
 * leaf_first). A slot whose copy was replaced (rep, from the on_remove before) keeps its queue
 * and counts one access more; a key the ghost remembers goes to main; the rest to probation. */
static PyObject *s3_insert(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Views v = {.n = 0};
    Pol p;
    Ghost g;
    Py_ssize_t nk, width, nf, n, n2, nrep, repc;
    int64_t *tmp = NULL, *reptab = NULL;
    if (nargs != 15) {
        PyErr_SetString(PyExc_TypeError, "s3_insert takes 15 arguments");
        return NULL;
    }
    if (pol_views(&v, args, &p, 3, 1, "s3_insert") < 0 || ghost_views(&v, args + 5, &g,
                                                                      "s3_insert") < 0)
        goto fail;
    if (as_index(args[10], &width, "width") < 0 || width == 0)
        goto bad;
    const uint8_t *keys = view(&v, args[9], width, 0, &nk, NULL, "keycol");
    if (!keys)
        goto fail;
    const uint32_t *freq = view(&v, args[11], 4, 0, &nf, NULL, "freq");
    const int64_t *rows = freq ? view(&v, args[12], 8, 0, &n, NULL, "rows") : NULL;
    const int64_t *slots = rows ? view(&v, args[13], 8, 0, &n2, NULL, "slots") : NULL;
    const int64_t *rep = slots ? view(&v, args[14], 8, 0, &nrep, &repc, "rep") : NULL;
    if (!rep)
        goto fail;
    if (n2 != n || (nrep && repc != 3) || width <= 0 || slots_ok(&p, slots, n, "s3_insert") < 0)
        goto bad;
    for (Py_ssize_t i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= nf || rows[i] >= nk)
            goto bad;
    if (ring_room(&p, MAIN, n) < 0 || ring_room(&p, SMALL, n) < 0)
        goto fail;
    /* tmp: per position (in queue order) its slot, then [n..2n) the slots bound for main, then
     * [2n..3n) those for probation. */
    tmp = malloc(sizeof(int64_t) * (size_t)(3 * n + 1));
    if (!tmp) {
        PyErr_NoMemory();
        goto fail;
    }
    /* The replaced copies by hash: an open-addressed table of positions into rep, the first
     * entry of each hash kept (as the linear search it replaces found it: a rewrite of 4,096
     * keys searched 4,096 entries per key, ~8M compares, 5 ms of a 6 ms commit). */
    Py_ssize_t tmask = 0;
    if (nrep) {
        Py_ssize_t tsize = 16;
        while (tsize < 2 * nrep)
            tsize *= 2;
        tmask = tsize - 1;
        reptab = malloc(sizeof(int64_t) * (size_t)tsize);
        if (!reptab) {
            PyErr_NoMemory();
            goto fail;
        }
        memset(reptab, 0xff, sizeof(int64_t) * (size_t)tsize);      /* -1: empty */
        for (Py_ssize_t j = 0; j < nrep; j++) {
            uint64_t h = (uint64_t)rep[3 * j];
            Py_ssize_t at = (Py_ssize_t)(h & (uint64_t)tmask);
            while (reptab[at] >= 0 && (uint64_t)rep[3 * reptab[at]] != h)
                at = (at + 1) & tmask;
            if (reptab[at] < 0)
                reptab[at] = j;
        }
    }
    int rev = p.st[ST_LEAF_FIRST] && n > 1;
    for (Py_ssize_t i = 0; i < n; i++) {       /* copies replaced while queued leave a count */
        int8_t w = p.where[slots[i]];
        if (w == SMALL || w == MAIN)
            p.st[ST_COUNT0 + w]--;
    }
    Py_ssize_t nm = 0, nsm = 0;
    int64_t freq_max = p.st[ST_FREQ_MAX];
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t at = rev ? n - 1 - i : i;
        int64_t s = slots[at], r = rows[at];
        uint64_t h = hash_one(keys + r * width, width);
        int64_t fr = (int64_t)freq[r];
        STAMP(&p, s) = p.st[ST_NEXT] + i;
        BASE(&p, s) = fr;
        CNT(&p, s) = 0;
        int q = -1;
        for (Py_ssize_t at = (Py_ssize_t)(h & (uint64_t)tmask); nrep && reptab[at] >= 0;
             at = (at + 1) & tmask) {
            Py_ssize_t j = reptab[at];
            if ((uint64_t)rep[3 * j] == h) {   /* the first entry of that key, as _positions */
                q = (int)rep[3 * j + 1];
                int64_t c = rep[3 * j + 2] + 1;
                CNT(&p, s) = c < freq_max ? c : freq_max;
                BASE(&p, s) = fr - (q == SMALL);
                break;
            }
        }
        if (q < 0) {
            int seen = ghost_pull(&g, h);
            p.st[ST_GHOST_HITS] += seen;
            q = seen ? MAIN : SMALL;
        }
        if (q == MAIN)
            tmp[n + nm++] = s;
        else
            tmp[2 * n + nsm++] = s;
    }
    p.st[ST_NEXT] += n;
    if (push(&p, MAIN, tmp + n, nm, 0) < 0 || push(&p, SMALL, tmp + 2 * n, nsm, 0) < 0)
        goto fail;
    free(tmp);
    free(reptab);
    views_release(&v);
    Py_RETURN_NONE;
bad:
    PyErr_SetString(PyExc_ValueError, "s3_insert: rows, slots or rep do not fit the arrays");
fail:
    free(tmp);
    free(reptab);
    views_release(&v);
    return NULL;
}

/* S3Fifo.on_remove(slots): the queued ones leave their queue; those handed out as victims are
 * remembered by the ghost, in order; the others (a copy being replaced) are written to out_rep
 * as (hash, queue, counter) for the on_insert that follows. Returns how many, or -1 when no
 * slot was queued (the caller's stash stays as it was). */
static PyObject *s3_remove(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Views v = {.n = 0};
    Pol p;
    Ghost g;
    Py_ssize_t nr, nk, width, n, no, oc;
    uint64_t *evicted = NULL;
    if (nargs != 12) {
        PyErr_SetString(PyExc_TypeError, "s3_remove takes 12 arguments");
        return NULL;
    }
    /* per, where, st (no rings), then the ghost from args[3] */
    if (pol_views(&v, args, &p, 3, 0, "s3_remove") < 0 || ghost_views(&v, args + 3, &g,
                                                                      "s3_remove") < 0)
        goto fail;
    const int64_t *slot_row = view(&v, args[7], 8, 0, &nr, NULL, "slot_row");
    if (!slot_row)
        goto fail;
    if (as_index(args[9], &width, "width") < 0 || width == 0)
        goto bad;
    const uint8_t *keys = view(&v, args[8], width, 0, &nk, NULL, "keycol");
    if (!keys)
        goto fail;
    const int64_t *slots = view(&v, args[10], 8, 0, &n, NULL, "slots");
    int64_t *out = slots ? view(&v, args[11], 8, 1, &no, &oc, "out_rep") : NULL;
    if (!out)
        goto fail;
    if (nr != p.n_slots || no < n || oc != 3 || width <= 0
            || slots_ok(&p, slots, n, "s3_remove") < 0)
        goto bad;
    Py_ssize_t gone = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t s = slots[i];
        if (p.where[s] == NONE)
            continue;
        gone++;
        if (slot_row[s] < 0 || slot_row[s] >= nk)
            goto bad;
    }
    if (gone == 0) {
        views_release(&v);
        return PyLong_FromLong(-1);
    }
    evicted = malloc(sizeof(uint64_t) * (size_t)(n + 1));
    if (!evicted) {
        PyErr_NoMemory();
        goto fail;
    }
    Py_ssize_t ne = 0, k = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t s = slots[i];
        int8_t w = p.where[s];
        if (w == NONE)
            continue;
        if (w == SMALL || w == MAIN)
            p.st[ST_COUNT0 + w]--;
        uint64_t h = hash_one(keys + slot_row[s] * width, width);
        if (w >= PENDING) {
            evicted[ne++] = h;
        } else {
            out[3 * k] = (int64_t)h;
            out[3 * k + 1] = w;
            out[3 * k + 2] = CNT(&p, s);
            k++;
        }
        p.where[s] = NONE;
    }
    ghost_put(&g, evicted, ne);
    free(evicted);
    views_release(&v);
    return PyLong_FromSsize_t(k);
bad:
    PyErr_SetString(PyExc_ValueError, "s3_remove: slots, rows or outputs do not fit the arrays");
fail:
    free(evicted);
    views_release(&v);
    return NULL;
}

/* S3Fifo.victims(n): up to n unleased slots in eviction order, written to out; returns how
 * many. Entries are taken from a queue's head in windows of max(need, 32), as the numpy
 * version does, so that every decision (which queue, which entries) is the same. With the
 * ghost's arrays, the key column and its width after out (victims(n, drop=True)), the victims
 * are then forgotten as s3_remove forgets pending ones: the ghost remembers their keys in
 * order and their where is NONE (checked first: a victim without a row raises with them
 * pending, as s3_remove would have refused them). */
static int s3_drop_taken(Views *v, PyObject *const *args, Pol *p, const int64_t *slot_row,
                         const int64_t *out, int64_t taken, uint64_t *hashes);

static PyObject *s3_victims(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Views v = {.n = 0};
    Pol p;
    Py_ssize_t nr, nf, nl, n, no;
    int64_t *win = NULL;
    if (nargs != 10 && nargs != 16) {
        PyErr_SetString(PyExc_TypeError, "s3_victims takes 10 or 16 arguments");
        return NULL;
    }
    if (pol_views(&v, args, &p, 3, 1, "s3_victims") < 0)
        goto fail;
    const int64_t *slot_row = view(&v, args[5], 8, 0, &nr, NULL, "slot_row");
    const uint32_t *freq = slot_row ? view(&v, args[6], 4, 0, &nf, NULL, "freq") : NULL;
    const uint32_t *leases = freq ? view(&v, args[7], 4, 0, &nl, NULL, "leases") : NULL;
    if (!leases || as_index(args[8], &n, "n") < 0)
        goto fail;
    int64_t *out = view(&v, args[9], 8, 1, &no, NULL, "out");
    if (!out)
        goto fail;
    if (nr != p.n_slots || nl != p.n_slots || no < n) {
        PyErr_SetString(PyExc_ValueError, "s3_victims: arrays do not fit the tier");
        goto fail;
    }
    int64_t wcap = (n > 32 ? n : 32);
    win = malloc(sizeof(int64_t) * (size_t)(6 * wcap));   /* window: slot, stamp, freq, flags */
    if (!win) {
        PyErr_NoMemory();
        goto fail;
    }
    int64_t freq_max = p.st[ST_FREQ_MAX], target = p.st[ST_SMALL_TARGET];
    int64_t *count = &p.st[ST_COUNT0];
    int64_t budget = (freq_max + 2) * (count[0] + count[1]) + 64;
    int64_t need = n, taken = 0, leased_seen[2] = {0, 0};
    while (need > 0 && budget > 0 && count[0] + count[1] > 0) {
        int small = count[0] > 0 && (count[0] + n > target || count[1] == 0);
        int q = small ? SMALL : MAIN;
        int stuck[2] = {leased_seen[0] >= count[0], leased_seen[1] >= count[1]};
        if (stuck[q]) {
            if (stuck[1 - q] || count[1 - q] == 0)
                break;
            q = 1 - q;
        }
        int64_t want = need > 32 ? need : 32, mask = p.cap[q] - 1;
        int64_t got = want < RLEN(&p, q) ? want : RLEN(&p, q);
        if (got == 0) {                       /* counts and ring disagree: nothing to find */
            count[q] = 0;
            budget -= 1;
            continue;
        }
        budget -= got;
        /* Pop the window, keeping its current entries. */
        int64_t m = 0, head = RHEAD(&p, q);
        for (int64_t i = 0; i < got; i++) {
            int64_t at = (head + i) & mask;
            int64_t s = p.ring[q][2 * at], stamp = p.ring[q][2 * at + 1];
            if (valid(&p, s, stamp, q)) {
                win[4 * m] = s;
                win[4 * m + 1] = stamp;
                m++;
            }
        }
        RHEAD(&p, q) = (head + got) & mask;
        RLEN(&p, q) -= got;
        /* Settle the window, or, when it holds more victims than needed, the entries up to
         * the need-th (numpy's cut: with exactly need victims the whole window is settled). */
        int64_t cut = m, drop = 0, at_need = m;
        for (int64_t i = 0; i < m; i++) {
            int64_t s = win[4 * i], r = slot_row[s];
            if (r < 0 || r >= nf) {
                PyErr_SetString(PyExc_ValueError, "s3_victims: a queued slot has no row");
                goto fail;
            }
            int64_t fr = (int64_t)freq[r], acc = fr - BASE(&p, s);
            int held = leases[s] > 0, keep;
            if (q == SMALL) {
                keep = acc > 0 || held;
            } else {
                int64_t c = CNT(&p, s) + acc;
                keep = (c < freq_max ? c : freq_max) > 0 || held;
            }
            win[4 * i + 2] = fr;
            win[4 * i + 3] = keep | (held << 1);
            if (!keep && ++drop == need)
                at_need = i + 1;
        }
        if (drop > need)
            cut = at_need;
        /* The rest go back to the head untouched. */
        if (ring_room(&p, q, m - cut) < 0)
            goto fail;
        RHEAD(&p, q) = (RHEAD(&p, q) - (m - cut)) & mask;
        for (int64_t i = cut; i < m; i++)
            ring_put(&p, q, RHEAD(&p, q) + (i - cut), win[4 * i], win[4 * i + 1]);
        RLEN(&p, q) += m - cut;
        count[q] -= cut;
        /* Kept ones go on (to main, or back to probation while leased), in order; victims
         * are marked pending. */
        int64_t *to_main = win + 4 * wcap, *to_small = win + 5 * wcap, nup = 0, nheld = 0;
        for (int64_t i = 0; i < cut; i++) {
            int64_t s = win[4 * i];
            int keep = (int)(win[4 * i + 3] & 1), held = (int)(win[4 * i + 3] >> 1);
            int64_t acc = win[4 * i + 2] - BASE(&p, s);
            if (held)
                leased_seen[q]++;
            p.where[s] = NONE;
            BASE(&p, s) = win[4 * i + 2];
            if (q == SMALL) {
                if (keep && !held) {
                    CNT(&p, s) = 0;
                    to_main[nup++] = s;
                } else if (held) {
                    to_small[nheld++] = s;
                }
            } else {
                int64_t c = CNT(&p, s) + acc;
                c = c < freq_max ? c : freq_max;
                if (keep && !held)
                    c -= 1;
                CNT(&p, s) = c;
                if (keep)
                    to_main[nup++] = s;
            }
            if (!keep) {
                p.where[s] = (int8_t)(PENDING + q);
                out[taken++] = s;
                need--;
            }
        }
        if (push(&p, MAIN, to_main, nup, 0) < 0 || push(&p, SMALL, to_small, nheld, 0) < 0)
            goto fail;
    }
    /* win is spent: its first taken <= n <= wcap words hold the victims' hashes. */
    if (nargs == 16 && taken
            && s3_drop_taken(&v, args, &p, slot_row, out, taken, (uint64_t *)win) < 0)
        goto fail;
    free(win);
    views_release(&v);
    return PyLong_FromLongLong(taken);
fail:
    free(win);
    views_release(&v);
    return NULL;
}

/* s3_victims's drop: the taken victims' keys (args[10..15]: the ghost's arrays, the key
 * column, its width) into the ghost, in order, and their where NONE. 0, or -1 with an
 * exception and nothing written. */
static int s3_drop_taken(Views *v, PyObject *const *args, Pol *p, const int64_t *slot_row,
                         const int64_t *out, int64_t taken, uint64_t *hashes)
{
    Ghost g;
    Py_ssize_t width, nk;
    if (ghost_views(v, args + 10, &g, "s3_victims") < 0
            || as_index(args[15], &width, "width") < 0)
        return -1;
    const uint8_t *keys = width > 0 ? view(v, args[14], width, 0, &nk, NULL, "keycol") : NULL;
    if (!keys) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "s3_victims: a key width of 0");
        return -1;
    }
    for (int64_t i = 0; i < taken; i++)
        if (slot_row[out[i]] >= nk) {
            PyErr_SetString(PyExc_ValueError, "s3_victims: a victim's row is past the keys");
            return -1;
        }
    for (int64_t i = 0; i < taken; i++) {
        hashes[i] = hash_one(keys + slot_row[out[i]] * width, width);
        p->where[out[i]] = NONE;
    }
    ghost_put(&g, hashes, taken);
    return 0;
}

/* S3Fifo.give_back(slots): victims not used go back to the head of their queue, in order
 * (probation's first). */
static PyObject *s3_give_back(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Views v = {.n = 0};
    Pol p;
    Py_ssize_t n;
    int64_t *back = NULL;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "s3_give_back takes 6 arguments");
        return NULL;
    }
    const int64_t *slots = pol_views(&v, args, &p, 3, 1, "s3_give_back") < 0 ? NULL
        : view(&v, args[5], 8, 0, &n, NULL, "slots");
    if (!slots || slots_ok(&p, slots, n, "s3_give_back") < 0)
        goto fail;
    back = malloc(sizeof(int64_t) * (size_t)(n + 1));
    if (!back) {
        PyErr_NoMemory();
        goto fail;
    }
    for (int q = SMALL; q <= MAIN; q++) {
        Py_ssize_t k = 0;
        for (Py_ssize_t i = 0; i < n; i++)
            if (p.where[slots[i]] == PENDING + q)
                back[k++] = slots[i];
        if (push(&p, q, back, k, 1) < 0)
            goto fail;
    }
    free(back);
    views_release(&v);
    Py_RETURN_NONE;
fail:
    free(back);
    views_release(&v);
    return NULL;
}

/* ---------------------------------------------------------------- LruQueue */

/* LruQueue.on_insert's bookkeeping: the slots are queued (where 0) with fresh stamps, written
 * to out_stamps. Returns the epoch of the rows' last access when the batch has one, else -1
 * (the caller groups it by epoch). */
static PyObject *lru_insert(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Views v = {.n = 0};
    Pol p;
    Py_ssize_t n, n2, nl, no;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "lru_insert takes 7 arguments");
        return NULL;
    }
    const int64_t *rows = pol_views(&v, args, &p, 1, 0, "lru_insert") < 0 ? NULL
        : view(&v, args[3], 8, 0, &n, NULL, "rows");
    const int64_t *slots = rows ? view(&v, args[4], 8, 0, &n2, NULL, "slots") : NULL;
    const uint64_t *last = slots ? view(&v, args[5], 8, 0, &nl, NULL, "last_access") : NULL;
    int64_t *out = last ? view(&v, args[6], 8, 1, &no, NULL, "out_stamps") : NULL;
    if (!out)
        goto fail;
    if (n2 != n || no < n || slots_ok(&p, slots, n, "lru_insert") < 0)
        goto bad;
    for (Py_ssize_t i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= nl)
            goto bad;
    int64_t epoch = n ? (int64_t)(last[rows[0]] >> EPOCH_SHIFT) : -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t s = slots[i];
        p.where[s] = 0;
        STAMP(&p, s) = out[i] = p.st[ST_NEXT] + i;
        if ((int64_t)(last[rows[i]] >> EPOCH_SHIFT) != epoch)
            epoch = -1;
    }
    p.st[ST_NEXT] += n;
    views_release(&v);
    return PyLong_FromLongLong(epoch);
bad:
    PyErr_SetString(PyExc_ValueError, "lru_insert: rows or slots do not fit the arrays");
fail:
    views_release(&v);
    return NULL;
}

/* LruQueue.victims' pass over the sorted oldest bucket cur (slot, stamp, last access) from pos:
 * an entry no longer current is dropped, one accessed since the sort is written to moved (for
 * its new bucket), a leased one to held (it comes round again), any other is a victim (where
 * PENDING, written to out), until need victims, the end of cur, or a full moved or held.
 * With drop (a 12th argument, true) a victim's where is NONE at once: on_remove's work, for a
 * caller that frees every victim (victims(n, drop=True)). Returns (pos, victims, moved, held). */
static PyObject *lru_take(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    Views v = {.n = 0};
    Pol p;
    Py_ssize_t m, mc, pos, need, nr, nl, np_, no, sm, smc;
    if (nargs != 11 && nargs != 12) {
        PyErr_SetString(PyExc_TypeError, "lru_take takes 11 or 12 arguments");
        return NULL;
    }
    int drop = nargs == 12 ? PyObject_IsTrue(args[11]) : 0;
    if (drop < 0)
        return NULL;
    const int8_t taken_where = drop ? NONE : PENDING;
    const int64_t *cur = pol_views(&v, args, &p, 1, 0, "lru_take") < 0 ? NULL
        : view(&v, args[3], 8, 0, &m, &mc, "cur");
    if (!cur || as_index(args[4], &pos, "pos") < 0 || as_index(args[5], &need, "need") < 0)
        goto fail;
    const int64_t *slot_row = view(&v, args[6], 8, 0, &nr, NULL, "slot_row");
    const uint64_t *last = slot_row ? view(&v, args[7], 8, 0, &nl, NULL, "last_access") : NULL;
    const uint32_t *leases = last ? view(&v, args[8], 4, 0, &np_, NULL, "leases") : NULL;
    int64_t *out = leases ? view(&v, args[9], 8, 1, &no, NULL, "out") : NULL;
    int64_t *moved = out ? view(&v, args[10], 8, 1, &sm, &smc, "moved") : NULL;
    if (!moved)
        goto fail;
    /* moved holds both lists: moved entries from its start, held ones from its end. */
    if ((m && mc != 3) || smc != 3 || nr != p.n_slots || np_ != p.n_slots
            || no < need || sm < 2) {
        PyErr_SetString(PyExc_ValueError, "lru_take: arrays do not fit the tier");
        goto fail;
    }
    Py_ssize_t k = 0, nm = 0, nh = 0;
    while (pos < m && k < need && nm + nh < sm) {
        int64_t s = cur[3 * pos], stamp = cur[3 * pos + 1], was = cur[3 * pos + 2];
        pos++;
        if (!valid(&p, s, stamp, 0))
            continue;
        int64_t r = slot_row[s];
        if (r < 0 || r >= nl) {
            PyErr_SetString(PyExc_ValueError, "lru_take: a queued slot has no row");
            goto fail;
        }
        int64_t now = (int64_t)last[r];
        if (now != was) {                     /* accessed since the bucket was sorted */
            moved[3 * nm] = s;
            moved[3 * nm + 1] = stamp;
            moved[3 * nm + 2] = now;
            nm++;
        } else if (leases[s] > 0) {
            nh++;
            moved[3 * (sm - nh)] = s;
            moved[3 * (sm - nh) + 1] = stamp;
            moved[3 * (sm - nh) + 2] = now;
        } else {
            p.where[s] = taken_where;
            out[k++] = s;
        }
    }
    views_release(&v);
    /* The tuple made directly: Py_BuildValue parses its format, ~1k instructions a call. */
    Py_ssize_t got[4] = {pos, k, nm, nh};
    PyObject *res = PyTuple_New(4);
    for (int i = 0; res != NULL && i < 4; i++) {
        PyObject *x = PyLong_FromSsize_t(got[i]);
        if (x == NULL)
            Py_CLEAR(res);             /* its items so far go with it */
        else
            PyTuple_SET_ITEM(res, i, x);
    }
    return res;
fail:
    views_release(&v);
    return NULL;
}

static PyMethodDef methods[] = {
    {"ghost_add", (PyCFunction)(void (*)(void))ghost_add, METH_FASTCALL,
     "ghost_add(fp, seq, alive, state, hashes): policies.rings.Ghost.add (see _queues.c)."},
    {"ghost_take", (PyCFunction)(void (*)(void))ghost_take, METH_FASTCALL,
     "ghost_take(fp, seq, alive, state, hashes, out): policies.rings.Ghost.take."},
    {"s3_insert", (PyCFunction)(void (*)(void))s3_insert, METH_FASTCALL,
     "s3_insert(...): S3Fifo.on_insert (see _queues.c)."},
    {"s3_remove", (PyCFunction)(void (*)(void))s3_remove, METH_FASTCALL,
     "s3_remove(...) -> k or -1: S3Fifo.on_remove (see _queues.c)."},
    {"s3_victims", (PyCFunction)(void (*)(void))s3_victims, METH_FASTCALL,
     "s3_victims(...) -> k: S3Fifo.victims (see _queues.c)."},
    {"s3_give_back", (PyCFunction)(void (*)(void))s3_give_back, METH_FASTCALL,
     "s3_give_back(...): S3Fifo.give_back (see _queues.c)."},
    {"lru_insert", (PyCFunction)(void (*)(void))lru_insert, METH_FASTCALL,
     "lru_insert(...) -> epoch or -1: LruQueue.on_insert's bookkeeping (see _queues.c)."},
    {"lru_take", (PyCFunction)(void (*)(void))lru_take, METH_FASTCALL,
     "lru_take(...) -> (pos, taken, moved, held): LruQueue.victims' pass (see _queues.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_queues",
    "The eviction policies' queues and ghost in C (see _queues.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__queues(void)
{
    return PyModule_Create(&module);
}
