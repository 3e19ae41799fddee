/* The ghost of evicted keys (policies.rings.Ghost) in C, for kvtier.coherence.policies._queues:
 * an exact FIFO of the last `size` keys added and not taken back, over sequence numbers, found by
 * a 32-bit fingerprint in a two-choice 4-way set-associative table (rings.py says why). The
 * arrays are the Ghost object's: fp u32[sets, 4], seq i64[sets, 4], alive bool[a] and st i64[4]
 * (head, tail, live, size); sets and a are powers of two. Include after cviews.h. */
#ifndef KVTIER_GHOST_H
#define KVTIER_GHOST_H

#include <stdint.h>

typedef struct {
    uint32_t *fp;
    int64_t *seq;
    uint8_t *alive;
    int64_t *st;                 /* head, tail, live, size */
    uint64_t set_mask, alive_mask;
} Ghost;

#define WAYS 4

static inline int counted(const Ghost *g, int64_t s)
{
    return s >= g->st[1] && g->alive[(uint64_t)s & g->alive_mask];
}

static inline void forget(Ghost *g, int64_t s)
{
    uint8_t *a = &g->alive[(uint64_t)s & g->alive_mask];
    if (s >= 0 && *a) {
        *a = 0;
        g->st[2]--;
    }
}

static inline void split(const Ghost *g, uint64_t h, uint64_t *a, uint64_t *b, uint32_t *fp)
{
    *a = h & g->set_mask;
    *b = (h >> 20) & g->set_mask;
    *fp = (uint32_t)(h >> 32) | 1u;
}

/* The entry of fp in set a or b that still counts: its flat index, or -1. */
static inline int64_t find(const Ghost *g, uint64_t a, uint64_t b, uint32_t fp)
{
    uint64_t sets[2] = {a, b};
    for (int k = 0; k < 2; k++)
        for (int w = 0; w < WAYS; w++) {
            int64_t at = (int64_t)(sets[k] * WAYS + w);
            if (g->fp[at] == fp && counted(g, g->seq[at]))
                return at;
        }
    return -1;
}

static void advance_to(Ghost *g, int64_t tail)
{
    for (int64_t s = g->st[1]; s < tail; s++)
        forget(g, s);
    if (tail > g->st[1])
        g->st[1] = tail;
}

/* The ghost's four arrays from args[0..3]; -1 (and an exception) when they are not one. */
static int ghost_views(Views *v, PyObject *const *args, Ghost *g, const char *name)
{
    Py_ssize_t sets, ways, sets2, ways2, alen, slen;
    g->fp = view(v, args[0], 4, 1, &sets, &ways, name);
    g->seq = g->fp ? view(v, args[1], 8, 1, &sets2, &ways2, name) : NULL;
    g->alive = g->seq ? view(v, args[2], 1, 1, &alen, NULL, name) : NULL;
    g->st = g->alive ? view(v, args[3], 8, 1, &slen, NULL, name) : NULL;
    if (!g->st)
        return -1;
    if (ways != WAYS || ways2 != WAYS || sets2 != sets || (sets & (sets - 1)) || sets == 0
            || (alen & (alen - 1)) || alen == 0 || slen != 4 || g->st[1] < 0
            || g->st[0] < g->st[1] || g->st[0] - g->st[1] > alen) {
        PyErr_Format(PyExc_ValueError, "%s: not a ghost's arrays (see _queues.c)", name);
        return -1;
    }
    g->set_mask = (uint64_t)sets - 1;
    g->alive_mask = (uint64_t)alen - 1;
    return 0;
}

/* Ghost.add: the keys remembered in order, a key already remembered renewed; only the last
 * `size` of a batch can stay, so only those are placed. */
static void ghost_put(Ghost *g, const uint64_t *hashes, Py_ssize_t n)
{
    int64_t size = g->st[3];
    if (size <= 0)
        return;
    for (Py_ssize_t i = n > size ? n - (Py_ssize_t)size : 0; i < n; i++) {
        uint64_t a, b;
        uint32_t fp;
        split(g, hashes[i], &a, &b, &fp);
        int64_t at = find(g, a, b, fp);
        if (at >= 0) {                        /* renewed: its old entry forgotten first */
            forget(g, g->seq[at]);
            g->fp[at] = 0;
        }
        int64_t head = g->st[0];
        if (head + 1 - g->st[1] > (int64_t)(g->alive_mask + 1))
            advance_to(g, head + 1 - (int64_t)(g->alive_mask + 1));
        /* The emptier of the two sets; the way that no longer counts, or the oldest. */
        int ca = 0, cb = 0;
        for (int w = 0; w < WAYS; w++) {
            ca += counted(g, g->seq[a * WAYS + w]);
            cb += counted(g, g->seq[b * WAYS + w]);
        }
        uint64_t set = cb < ca ? b : a;
        int64_t pick = -1, oldest = -1;
        for (int w = 0; w < WAYS && pick < 0; w++) {
            int64_t e = (int64_t)(set * WAYS + w);
            if (!counted(g, g->seq[e]))
                pick = e;
            else if (oldest < 0 || g->seq[e] < g->seq[oldest])
                oldest = e;
        }
        if (pick < 0) {
            pick = oldest;
            forget(g, g->seq[pick]);
        }
        g->fp[pick] = fp;
        g->seq[pick] = head;
        g->alive[(uint64_t)head & g->alive_mask] = 1;
        g->st[2]++;
        g->st[0] = head + 1;
        /* Over size: the tail moves past the oldest live entries. */
        while (g->st[2] > size && g->st[1] < g->st[0]) {
            forget(g, g->st[1]);
            g->st[1]++;
        }
    }
}

/* Ghost.take of one key: whether it was remembered; if so it is forgotten. */
static inline int ghost_pull(Ghost *g, uint64_t h)
{
    uint64_t a, b;
    uint32_t fp;
    if (g->st[3] <= 0)
        return 0;
    split(g, h, &a, &b, &fp);
    int64_t at = find(g, a, b, fp);
    if (at < 0)
        return 0;
    forget(g, g->seq[at]);
    g->fp[at] = 0;
    g->seq[at] = -1;
    return 1;
}

#endif
