/* The native-AIO submit/reap loop shared by _aio.c (tiers/aio.py's batches) and _reads.c (an
 * NVMe get's read), run without the GIL.
 *
 *   aio_loop(ctx, ptrs, n, first, window, res, nres, ev, &fatal, on_done, arg) -> Py_ssize_t
 *       Submits ptrs[first..n-1] with at most `window` in flight and reaps them; the result of
 *       each (bytes moved, or -errno) lands in res[its aio_data] (aio_data < nres, else it is
 *       dropped). ev: room for `window` events. on_done (or NULL): called with arg and the
 *       iocb of each request reaped, once its res is set, while the others are in flight (an
 *       NVMe get hashes each record there: _reads.c). A request io_submit refuses outright (EBADF,
 *       EINVAL) gets -errno and the rest go on. Returns n when all are done, or the index of
 *       the first request not submitted when the kernel's queue refused one with nothing in
 *       flight (EAGAIN): the caller does that one synchronously and calls again. Nothing is
 *       in flight when it returns, except when io_getevents fails other than by EINTR: then
 *       *fatal is its errno, requests may be in flight, and the caller must io_destroy the
 *       context (which waits for them) before any buffer is freed.
 */
#ifndef KVTIER_AIO_LOOP_H
#define KVTIER_AIO_LOOP_H

#include <errno.h>
#include <linux/aio_abi.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

static Py_ssize_t aio_loop(aio_context_t ctx, struct iocb **ptrs, Py_ssize_t n,
                           Py_ssize_t first, long window, int64_t *res, Py_ssize_t nres,
                           struct io_event *ev, int *fatal,
                           void (*on_done)(void *, const struct iocb *), void *arg)
{
    Py_ssize_t nxt = first;
    long inflight = 0;
    *fatal = 0;
    while (nxt < n || inflight) {
        long k = window - inflight;
        if (k > n - nxt)
            k = (long)(n - nxt);
        if (k > 0) {
            long got = syscall(SYS_io_submit, ctx, k, ptrs + nxt);
            if (got >= 0) {
                nxt += got;
                inflight += got;
            } else if (errno == EAGAIN) {
                if (inflight == 0)
                    break;                   /* the caller does this one synchronously */
            } else if (errno != EINTR) {
                uint64_t i = ptrs[nxt]->aio_data;
                if (i < (uint64_t)nres)
                    res[i] = -(int64_t)errno;    /* this request is refused; the rest go on */
                nxt++;
                continue;
            }
        }
        if (inflight) {
            long got = syscall(SYS_io_getevents, ctx, 1L, window, ev, NULL);
            if (got < 0) {
                if (errno == EINTR)
                    continue;
                *fatal = errno;
                break;
            }
            for (long j = 0; j < got; j++) {
                uint64_t i = ev[j].data;
                if (i < (uint64_t)nres) {
                    res[i] = ev[j].res;
                    if (on_done != NULL)
                        on_done(arg, (const struct iocb *)(uintptr_t)ev[j].obj);
                }
            }
            inflight -= got;
        }
    }
    return nxt;
}

#endif
