"""XXH3-64 of KV blocks on the GPU, so that an offload's commit need not hash every byte on the
service's CPU (the commit waited 9.6 ms of a 17.5 ms put of 4,096 x 64 KiB on the H200).

The same function the service computes (xxh3-64, seed 0, default secret): the checksum the
worker sends with the commit is the one every later read from NVMe or Redis is checked against,
so a wrong GPU hash could only make a block fail its check (dropped and counted), never serve
wrong bytes. Only the long-input path (blocks over 240 bytes) in whole 64-byte stripes, with
every page a multiple of 64 bytes (a page never splits a stripe); other blocks are hashed by the
service as before (``supported``).

Layout of the work (kernels.XXH3): one block per 4 threads, thread t keeping accumulator lanes
2t and 2t+1 (a lane's update reads its partner's input word, which is in the same 16 bytes),
walking the block's stripes in order across its pages; the four partial merges are summed by
warp shuffles. ``reference`` is the same computation in numpy, checked against python-xxhash
on the CPU (tests/test_gpu_plan.py); the kernel is checked against it on the H200.
"""

from __future__ import annotations

import functools

import numpy as np

# The 192-byte default secret of XXH3 (a constant of the algorithm).
SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
    "eac5ac8334d3ebc3c581a0fffa1363eb170ddd51b7f0da49d316552629d4689e"
    "2b16be587d47a1fc8ff8b8d17ad031ce45cb3a8f95160428afd7fbcabb4b407e")
P32_1, P32_2, P32_3 = 0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D
P64_1, P64_2, P64_3 = 0x9E3779B185EBCA87, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9
P64_4, P64_5 = 0x85EBCA77C2B2AE63, 0x27D4EB2F165667C5
MX1 = 0x165667919E3779F9
INIT = (P32_3, P64_1, P64_2, P64_3, P64_4, P32_2, P64_5, P32_1)
STRIPE = 64


def _le64(off: int) -> int:
    return int.from_bytes(SECRET[off:off + 8], "little")


@functools.lru_cache(maxsize=1)
def key_table() -> np.ndarray:
    """The secret words the kernel reads, as uint64: [0:128] stripe j lane l (j * 8 + l), then
    the scramble words, the last stripe's, the merge's, and the initial accumulators. A
    constant, built once (read-only): a put's set-up built it anew, 152 words through Python
    (~200 us of a GPU put's host time under cProfile, off7)."""
    words = [_le64(8 * j + 8 * lane) for j in range(16) for lane in range(8)]
    words += [_le64(128 + 8 * lane) for lane in range(8)]     # scramble (secret end - 64)
    words += [_le64(121 + 8 * lane) for lane in range(8)]     # last stripe (end - 64 - 7)
    words += [_le64(11 + 8 * lane) for lane in range(8)]      # merge (offset 11)
    words += list(INIT)
    table = np.array(words, dtype=np.uint64)
    table.setflags(write=False)
    return table


def supported(block_bytes: int, page_bytes: tuple[int, ...]) -> bool:
    return block_bytes > 240 and all(p % STRIPE == 0 for p in page_bytes)


_M32 = np.uint64(0xFFFFFFFF)


def _mul128_fold(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """(a * b) as 128 bits, low half xor high half (uint64 arrays, wrapping)."""
    s32 = np.uint64(32)
    a_lo, a_hi, b_lo, b_hi = a & _M32, a >> s32, b & _M32, b >> s32
    ll, lh, hl, hh = a_lo * b_lo, a_lo * b_hi, a_hi * b_lo, a_hi * b_hi
    mid = (ll >> s32) + (lh & _M32) + (hl & _M32)
    lo = (ll & _M32) | ((mid & _M32) << s32)
    hi = hh + (lh >> s32) + (hl >> s32) + (mid >> s32)
    return lo ^ hi


def reference(blocks: np.ndarray) -> np.ndarray:
    """xxh3-64 of each row of a (n, L) uint8 array with supported(L): the kernel's computation
    in numpy (slow; for tests)."""
    n, length = blocks.shape
    k = key_table()
    words = np.ascontiguousarray(blocks).view("<u8").reshape(n, length // STRIPE, 8)
    acc = np.tile(k[152:160], (n, 1))
    s32, s47 = np.uint64(32), np.uint64(47)
    stripes = length // STRIPE
    partner = np.array([1, 0, 3, 2, 5, 4, 7, 6])

    def accumulate(d: np.ndarray, sec: np.ndarray) -> None:
        key = d ^ sec
        acc[:] += d[:, partner] + (key & _M32) * (key >> s32)

    for s in range(stripes - 1):
        j = s % 16
        accumulate(words[:, s], k[j * 8:j * 8 + 8])
        if j == 15:
            a = acc ^ (acc >> s47)
            acc[:] = (a ^ k[128:136]) * np.uint64(P32_1)
    accumulate(words[:, stripes - 1], k[136:144])
    m = k[144:152]
    total = np.full(n, np.uint64((length * P64_1) & ((1 << 64) - 1)))
    for i in range(4):
        total += _mul128_fold(acc[:, 2 * i] ^ m[2 * i], acc[:, 2 * i + 1] ^ m[2 * i + 1])
    total ^= total >> np.uint64(37)
    total *= np.uint64(MX1)
    total ^= total >> s32
    return total
