"""The CUDA kernels of the GPU data path (compiled by cupy's NVRTC on first use, per device).

move_pages16 / move_pages8: pages between slots and the engine's tensors (plan.py), one launch
for a run of equal-sized pages of many blocks. A grid-stride loop over every vector of the
launch, four vectors in flight per thread (eight device to device), bounded to the grid the caller gives (a few thread
blocks for host memory, so a few SMs): over PCIe a few SMs with enough loads in flight reach
the link's speed, and the rest stay with the model. Vector g of the launch is vector
g % vecs of page (p0 + item % np_) of block item / np_, item = g / vecs: consecutive threads
touch consecutive bytes of one page, so both sides are coalesced.

place_items16: a staged placement from device staging, a thread group per page.

xxh3_pages: kvtier.gpu.xxh3's hash of each block, read in place from its pages.
"""

from __future__ import annotations

from typing import Any

SOURCE = r"""
template <typename T, int U>
__device__ __forceinline__ void move_pages(
        unsigned long long seg, long long block_bytes, const long long* __restrict__ tab,
        int P, const long long* __restrict__ slots, const long long* __restrict__ rows,
        int n, int p0, int np_, unsigned int vecs, int to_seg) {
    const unsigned long long* pbase = (const unsigned long long*)tab;
    const long long* pstride = tab + P;
    const long long* poff = tab + 2 * P;
    const unsigned int total = (unsigned int)n * (unsigned int)np_ * vecs;
    const unsigned int nthreads = gridDim.x * blockDim.x;
    for (unsigned int g0 = blockIdx.x * blockDim.x + threadIdx.x; g0 < total;
         g0 += (unsigned int)U * nthreads) {
        T v[U];
        T* dst[U];
#pragma unroll
        for (int u = 0; u < U; u++) {
            const unsigned int g = g0 + u * nthreads;
            dst[u] = 0;
            if (g < total) {
                const unsigned int item = g / vecs, w = g - item * vecs;
                const unsigned int i = item / np_, p = p0 + (item - i * np_);
                T* a = (T*)(seg + slots[i] * block_bytes + poff[p]) + w;
                T* b = (T*)(pbase[p] + rows[i] * pstride[p]) + w;
                if (to_seg) { v[u] = *b; dst[u] = a; } else { v[u] = *a; dst[u] = b; }
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (dst[u]) *dst[u] = v[u];
        }
    }
}

extern "C" __global__ void move_pages16(unsigned long long seg, long long block_bytes,
        const long long* tab, int P, const long long* slots, const long long* rows, int n,
        int p0, int np_, unsigned int vecs, int to_seg) {
    move_pages<ulonglong2, 4>(seg, block_bytes, tab, P, slots, rows, n, p0, np_, vecs, to_seg);
}

// Device to device (the HBM tier): eight vectors in flight per thread, a full grid.
extern "C" __global__ void move_pages16_deep(unsigned long long seg, long long block_bytes,
        const long long* tab, int P, const long long* slots, const long long* rows, int n,
        int p0, int np_, unsigned int vecs, int to_seg) {
    move_pages<ulonglong2, 8>(seg, block_bytes, tab, P, slots, rows, n, p0, np_, vecs, to_seg);
}

// Device to device (the HBM tier), pages of whole 16-byte vectors: one thread block per page
// of a block (an item) at a time, its threads striding over that page with four vectors in
// flight each. move_pages16_deep divides twice per vector to find its page (runtime
// divisors); here a block finds its page once. H200, 1,024 x 2 MiB from the HBM pool, the
// kernel alone: 1.11 ms against 1.25 (a 2 GiB device copy: 1.02).
extern "C" __global__ void move_items16(unsigned long long seg, long long block_bytes,
        const long long* __restrict__ tab, int P, const long long* __restrict__ slots,
        const long long* __restrict__ rows, int n, int p0, int np_, unsigned int vecs,
        int to_seg) {
    const unsigned long long* pbase = (const unsigned long long*)tab;
    const long long* pstride = tab + P;
    const long long* poff = tab + 2 * P;
    const unsigned int items = (unsigned int)n * (unsigned int)np_;
    for (unsigned int item = blockIdx.x; item < items; item += gridDim.x) {
        const unsigned int i = item / np_, p = p0 + (item - i * np_);
        ulonglong2* a = (ulonglong2*)(seg + slots[i] * block_bytes + poff[p]);
        ulonglong2* b = (ulonglong2*)(pbase[p] + rows[i] * pstride[p]);
        const ulonglong2* src = to_seg ? b : a;
        ulonglong2* dst = to_seg ? a : b;
        for (unsigned int w0 = threadIdx.x; w0 < vecs; w0 += 4u * blockDim.x) {
            ulonglong2 v[4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const unsigned int w = w0 + u * blockDim.x;
                if (w < vecs) v[u] = src[w];
            }
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const unsigned int w = w0 + u * blockDim.x;
                if (w < vecs) dst[w] = v[u];
            }
        }
    }
}

// A staged placement (Mover.stage_sorted, _staged): device staging to the engine's pages,
// pages of whole 16-byte vectors. As move_items16, a page of a block (an item) found once per
// thread group, not per vector; a thread block takes `group` items at a time, blockDim.x /
// group threads each, so a 16 KiB page (1,024 vectors) keeps 256 threads busy with four
// vectors in flight and a block of 1,024 threads places four pages at once. move_pages16
// divides twice and loads four table words per vector.
extern "C" __global__ void place_items16(unsigned long long seg, long long block_bytes,
        const long long* __restrict__ tab, int P, const long long* __restrict__ slots,
        const long long* __restrict__ rows, int n, int p0, int np_, unsigned int vecs,
        int to_seg, unsigned int group) {
    const unsigned long long* pbase = (const unsigned long long*)tab;
    const long long* pstride = tab + P;
    const long long* poff = tab + 2 * P;
    const unsigned int items = (unsigned int)n * (unsigned int)np_;
    const unsigned int width = blockDim.x / group;
    const unsigned int g = threadIdx.x / width, t = threadIdx.x - g * width;
    if (g >= group) return;                  // no barrier below: idle threads may leave
    for (unsigned int item = blockIdx.x * group + g; item < items; item += gridDim.x * group) {
        const unsigned int i = item / np_, p = p0 + (item - i * np_);
        ulonglong2* a = (ulonglong2*)(seg + slots[i] * block_bytes + poff[p]);
        ulonglong2* b = (ulonglong2*)(pbase[p] + rows[i] * pstride[p]);
        const ulonglong2* src = to_seg ? b : a;
        ulonglong2* dst = to_seg ? a : b;
        for (unsigned int w0 = t; w0 < vecs; w0 += 4u * width) {
            ulonglong2 v[4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const unsigned int w = w0 + u * width;
                if (w < vecs) v[u] = src[w];
            }
#pragma unroll
            for (int u = 0; u < 4; u++) {
                const unsigned int w = w0 + u * width;
                if (w < vecs) dst[w] = v[u];
            }
        }
    }
}

extern "C" __global__ void move_pages8(unsigned long long seg, long long block_bytes,
        const long long* tab, int P, const long long* slots, const long long* rows, int n,
        int p0, int np_, unsigned int vecs, int to_seg) {
    move_pages<unsigned long long, 4>(seg, block_bytes, tab, P, slots, rows, n, p0, np_, vecs,
                                      to_seg);
}

// All layers of a per-layer transfer in one launch, layer after layer: after its share of
// layer l, each thread block adds one to counters[l], so counters[l] == gridDim.x when layer l
// has moved (a stream waits for that with cuStreamWaitValue32, kvtier.gpu.streams). One launch
// holds its few SMs from the first layer to the last; one launch per layer had to win SMs back
// from the model's kernels for every layer.
template <typename T, int U>
__device__ __forceinline__ void move_layers(
        unsigned long long seg, long long block_bytes, const long long* __restrict__ tab,
        int P, const long long* __restrict__ slots, const long long* __restrict__ rows,
        int n, int p0, int np_, unsigned int vecs, int to_seg, int layers,
        unsigned int* counters) {
    for (int l = 0; l < layers; l++) {
        move_pages<T, U>(seg, block_bytes, tab, P, slots, rows, n, p0 + l * np_, np_, vecs,
                         to_seg);
        __threadfence_system();
        __syncthreads();
        if (threadIdx.x == 0) atomicAdd(&counters[l], 1u);
    }
}

extern "C" __global__ void move_layers16(unsigned long long seg, long long block_bytes,
        const long long* tab, int P, const long long* slots, const long long* rows, int n,
        int p0, int np_, unsigned int vecs, int to_seg, int layers, unsigned int* counters) {
    move_layers<ulonglong2, 4>(seg, block_bytes, tab, P, slots, rows, n, p0, np_, vecs,
                               to_seg, layers, counters);
}

extern "C" __global__ void move_layers8(unsigned long long seg, long long block_bytes,
        const long long* tab, int P, const long long* slots, const long long* rows, int n,
        int p0, int np_, unsigned int vecs, int to_seg, int layers, unsigned int* counters) {
    move_layers<unsigned long long, 4>(seg, block_bytes, tab, P, slots, rows, n, p0, np_,
                                       vecs, to_seg, layers, counters);
}

__device__ __forceinline__ void xxh_acc(unsigned long long& a0, unsigned long long& a1,
                                        ulonglong2 d, unsigned long long k0,
                                        unsigned long long k1) {
    const unsigned long long x0 = d.x ^ k0, x1 = d.y ^ k1;
    a0 += d.y + (x0 & 0xFFFFFFFFull) * (x0 >> 32);
    a1 += d.x + (x1 & 0xFFFFFFFFull) * (x1 >> 32);
}

__device__ __forceinline__ unsigned long long xxh_scramble(unsigned long long a,
                                                           unsigned long long k) {
    a ^= a >> 47;
    a ^= k;
    return a * 0x9E3779B1ull;
}

// One block per 4 threads; K is kvtier.gpu.xxh3.key_table(). Inactive threads of the last warp
// repeat the last block so that every shuffle has its partners; only lane 0 of a real block
// writes.
extern "C" __global__ void xxh3_pages(const long long* __restrict__ tab, int P,
        const long long* __restrict__ rows, int n, long long block_len,
        const unsigned long long* __restrict__ K, unsigned long long* __restrict__ out) {
    const unsigned long long* pbase = (const unsigned long long*)tab;
    const long long* pstride = tab + P;
    const long long* psize = tab + 3 * P;
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    const int lane = t & 3;
    const bool real = (t >> 2) < n;
    const int b = real ? (t >> 2) : n - 1;
    const long long row = rows[b];
    int p = 0;
    long long off = 0;
    const char* page = (const char*)(pbase[0] + row * pstride[0]);
    unsigned long long a0 = K[152 + 2 * lane], a1 = K[153 + 2 * lane];
    const long long stripes = block_len / 64;
    long long s = 0;
    while (s < stripes - 1) {
        const long long left = stripes - 1 - s;
        const int cnt = left < 16 ? (int)left : 16;
        ulonglong2 d[16];
#pragma unroll
        for (int u = 0; u < 16; u++) {
            if (u < cnt) {
                d[u] = *(const ulonglong2*)(page + off + 16 * lane);
                off += 64;
                if (off == psize[p] && p + 1 < P) {
                    p++;
                    off = 0;
                    page = (const char*)(pbase[p] + row * pstride[p]);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < 16; u++) {
            if (u < cnt) xxh_acc(a0, a1, d[u], K[u * 8 + 2 * lane], K[u * 8 + 2 * lane + 1]);
        }
        if (cnt == 16) {
            a0 = xxh_scramble(a0, K[128 + 2 * lane]);
            a1 = xxh_scramble(a1, K[129 + 2 * lane]);
        }
        s += cnt;
    }
    const ulonglong2 last = *(const ulonglong2*)(page + off + 16 * lane);
    xxh_acc(a0, a1, last, K[136 + 2 * lane], K[137 + 2 * lane]);
    const unsigned long long x = a0 ^ K[144 + 2 * lane], y = a1 ^ K[145 + 2 * lane];
    unsigned long long m = (x * y) ^ __umul64hi(x, y);
    m += __shfl_xor_sync(0xFFFFFFFFu, m, 1);
    m += __shfl_xor_sync(0xFFFFFFFFu, m, 2);
    if (real && lane == 0) {
        unsigned long long h = (unsigned long long)block_len * 0x9E3779B185EBCA87ull + m;
        h ^= h >> 37;
        h *= 0x165667919E3779F9ull;
        h ^= h >> 32;
        out[b] = h;
    }
}
"""

_cache: dict[tuple[int, str], Any] = {}


def get(name: str) -> Any:
    """The compiled kernel ``name`` on the current device."""
    import cupy
    key = (cupy.cuda.Device().id, name)
    k = _cache.get(key)
    if k is None:
        k = cupy.RawModule(code=SOURCE).get_function(name)
        _cache[key] = k
    return k
