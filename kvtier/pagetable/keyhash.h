/* The page table's key hash (table.py's _hash), shared by the C modules that hash keys:
 * kvtier.pagetable._native (the index) and kvtier.coherence.policies._queues (the ghost of
 * evicted keys, which remembers a key by this hash). Each 8-byte little-endian word (the last
 * one zero-padded) is mixed in with a multiply-xorshift, then a splitmix64 finaliser, seeded
 * with the width. */
#ifndef KVTIER_KEYHASH_H
#define KVTIER_KEYHASH_H

#include <stdint.h>
#include <string.h>

#define MIX1 0x9E3779B97F4A7C15ULL
#define MIX2 0xBF58476D1CE4E5B9ULL
#define MIX3 0x94D049BB133111EBULL

static inline uint64_t hash_one(const uint8_t *key, Py_ssize_t width)
{
    uint64_t h = (uint64_t)width;
    Py_ssize_t off = 0;
    for (; off + 8 <= width; off += 8) {
        uint64_t w;
        memcpy(&w, key + off, 8);
        h = (h ^ w) * MIX1;
        h ^= h >> 31;
    }
    if (off < width) {
        uint64_t w = 0;
        memcpy(&w, key + off, (size_t)(width - off));
        h = (h ^ w) * MIX1;
        h ^= h >> 31;
    }
    h = (h ^ (h >> 30)) * MIX2;
    h = (h ^ (h >> 27)) * MIX3;
    return h ^ (h >> 31);
}

#endif
