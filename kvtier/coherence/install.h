/* One row's install (Engine._install's columns for a committed copy), shared by
 * kvtier.coherence._fast.install_rows and kvtier.pagetable._native.put_rows (a host put
 * of new keys in one call): the same writes in the same order, in one place. */
#ifndef KVTIER_INSTALL_H
#define KVTIER_INSTALL_H

#include <stdint.h>
#include <Python.h>

typedef struct {
    uint64_t *version;
    uint16_t *leases;
    uint32_t *size;
    uint64_t *sums;
    uint8_t *state;
    uint64_t *last;
    uint64_t *prev;
    uint32_t *freq;
    int32_t *slot;            /* rows x nsl */
    Py_ssize_t nsl;
    uint64_t *copy_ver;       /* rows x nt */
    Py_ssize_t nt;
    int64_t *slot_row;        /* the tier's pool: slot -> row */
} InstallCols;

/* Row r now holds a committed copy in slot s of tier: a created row starts at floor; its
 * version becomes max(version, base) + 1 (returned); readers 0, size, checksum; the state
 * moves by next (checked by the caller: next[state[r]] != 255); the touch at stamp; the copy
 * placed (slot, copy_ver, slot_row). */
static inline uint64_t install_one(const InstallCols *c, int64_t r, int created, int64_t s,
                                   uint64_t sum, const uint8_t *next, Py_ssize_t tier,
                                   uint64_t floor_, uint64_t base, uint64_t stamp, uint32_t bb)
{
    if (created)
        c->version[r] = floor_;
    uint64_t ver = (c->version[r] > base ? c->version[r] : base) + 1;
    c->version[r] = ver;
    c->leases[r] = 0;
    c->size[r] = bb;
    c->sums[r] = sum;
    c->state[r] = next[c->state[r]];
    c->prev[r] = c->last[r];
    c->last[r] = stamp;
    c->freq[r] += 1;
    c->slot[r * c->nsl + tier] = (int32_t)s;
    c->copy_ver[r * c->nt + tier] = ver;
    c->slot_row[s] = r;
    return ver;
}

#endif
