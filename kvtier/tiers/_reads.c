/* kvtier.tiers._reads: an NVMe get's whole read in C: the records into their host slots by
 * native AIO, each block's XXH3 computed and compared, one verdict per record, all without
 * the GIL; and C threads that run such reads and signal an eventfd when one is done.
 *
 * Why (issue 17, bench/stall.py: a resident get beside NVMe readers). The read ran on a Python
 * I/O thread in three GIL-free C calls (the AIO loop, the checksums) joined by Python: the
 * thread took the GIL after the queue's wake-up, after the AIO and after the checksums, and
 * while the event loop ran a get's locked step each of those waited for CPython's 5 ms switch
 * interval to force the loop to drop the GIL mid-step (bench/stall_trace.py on the H200 host:
 * 74% of the decide steps blocked beside 8 readers). Batch.run is the whole read in one call
 * (one GIL hand-off left: the call's return); Reader runs Batches on its own threads, which
 * never take the GIL, and the loop learns of a finished read from an eventfd, as it learns of
 * a frame (no hand-off at all).
 *
 *   Batch(segtab, segs, offs, rows, into, nbytes, sums)
 *       One batch of records, checked and copied at construction (the caller's arrays are not
 *       held). segtab: int64 (k, 4), per segment held open by the caller (pinned) for the
 *       Batch's life: seg id, fd, file offset of record 0, bytes written. segs, offs, rows,
 *       sums: per record, int64 seg id, int64 offset in 4 KiB units, int64 row of the
 *       destination array, uint64 expected XXH3. into: the destination, a writable 2-D byte
 *       array (a host pool's) of 4 KiB-aligned rows of nbytes, the record and block size
 *       (BufferError otherwise); the caller keeps it alive until the batch is read. A record
 *       whose segment is not in segtab or that does not lie whole on a record boundary inside
 *       what was written is not read (its verdict is False: a bad record). A row outside the
 *       array raises IndexError: that is the caller's bug, never the disk's.
 *       .requests: the records that will be read.
 *   Batch.run(ctx, window, xxh3) -> None
 *       The read on the calling thread, the GIL released: ctx an io_setup context of at least
 *       `window` events, xxh3 the address of uint64_t XXH3_64bits(const void *, size_t)
 *       (tiers/reads.py's XXH3_READ, checked against python-xxhash). Each record is verified
 *       as its read is reaped, the others still in flight. OSError when io_getevents fails
 *       with requests in flight: the context is then destroyed here (io_destroy waits for
 *       them, so no slot is written after this returns) and the caller drops it.
 *   Batch.ok() -> bytes
 *       After a run: per record 1 when it was read whole and its XXH3 equals the expected
 *       one, else 0. Each run (or submit) forgets the last one's verdicts first, so after a
 *       failed re-run ok() raises rather than answer with an earlier read's.
 *   Reader(threads, depth, xxh3)
 *       `threads` C threads with an io_setup context of `depth` events each (OSError when the
 *       host-wide fs.aio-max-nr refuses one). .fd: an eventfd (non-blocking), readable once
 *       a submitted batch is done.
 *   Reader.submit(batch, token) -> None: queue a batch (held until reaped).
 *   Reader.reap() -> list of (token, errno): the batches done since the last reap (errno 0,
 *       or the io_getevents error that ended it; its context was then replaced).
 *   Reader.close(): finish the queued batches, stop the threads (the GIL released), drop
 *       what was never reaped. Also on deallocation.
 *   _fail_next_read(errno): tests' fault seam: the next read, wherever it runs, lands its
 *       bytes and then fails with errno as a failed io_getevents does (0: none).
 *
 * A request the kernel's queue refuses with nothing in flight (EAGAIN) is read by pread on the
 * same thread; a request refused outright (EBADF, EINVAL) is a failed record. Records are
 * submitted in (fd, offset) order, the log's order, as SegmentLog.read_rows does.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <linux/aio_abi.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "aio_loop.h"

#define ALIGN 4096

typedef uint64_t (*xxh3_fn)(const void *, size_t);

/* ------------------------------------------------------------------ the read itself */

typedef struct {
    PyObject_HEAD
    Py_ssize_t n;           /* records */
    Py_ssize_t nreq;        /* of them read (valid) */
    int64_t nbytes;
    struct iocb *cbs;       /* nreq, in (fd, offset) order; aio_data: record index */
    int64_t *res;           /* n: bytes read or -errno */
    uint64_t *want;         /* n */
    uint8_t *ok;            /* n */
    int ran;
    int queued;             /* in a Reader's queue or on one of its threads */
} Batch;

static int cmp_cb(const void *a, const void *b)
{
    const struct iocb *x = a, *y = b;
    if (x->aio_fildes != y->aio_fildes)
        return x->aio_fildes < y->aio_fildes ? -1 : 1;
    return x->aio_offset < y->aio_offset ? -1 : x->aio_offset > y->aio_offset;
}

/* The fault seam of tests/test_reads.py: the next batch_read (in Batch.run or on a Reader
 * thread) reads as usual, then fails as a failed io_getevents would, with this errno
 * (_reads._fail_next_read). 0: none. */
static int fail_next;

typedef struct {
    Batch *b;
    xxh3_fn h;
} verifier;

/* One record's verdict, as its read completes: read whole, and its XXH3 the one its row
 * names. Run as each request is reaped, so the records still in flight are read meanwhile
 * (issue 17, fio10: the hash of a 16 x 64 KiB get was ~0.06-0.1 ms after the last
 * completion, on the get's wall), and each block is hashed while it may still be in cache. */
static void verify_record(void *arg, const struct iocb *cb)
{
    verifier *v = arg;
    Batch *b = v->b;
    uint64_t r = cb->aio_data;
    b->ok[r] = b->res[r] == b->nbytes
               && v->h((const void *)(uintptr_t)cb->aio_buf, (size_t)b->nbytes) == b->want[r];
}

/* aio_loop.h's submit/reap loop over b's requests, each record verified as it lands. Returns
 * 0, or the errno of a failed io_getevents (requests may still be in flight: the caller
 * destroys ctx; the verdicts are then not to be read, and Batch.run says so). */
static int batch_read(Batch *b, aio_context_t ctx, long window, xxh3_fn h)
{
    Py_ssize_t n = b->nreq;
    if (window > n)
        window = n ? (long)n : 1;        /* no more can be in flight (and ev stays small) */
    for (Py_ssize_t i = 0; i < b->n; i++)
        b->res[i] = -EINVAL;             /* not read: refused by the bounds check */
    struct iocb **ptrs = malloc((size_t)(n ? n : 1) * sizeof *ptrs);
    struct io_event *ev = malloc((size_t)window * sizeof *ev);
    if (ptrs == NULL || ev == NULL) {
        free(ptrs);
        free(ev);
        return ENOMEM;
    }
    for (Py_ssize_t i = 0; i < n; i++)
        ptrs[i] = &b->cbs[i];
    memset(b->ok, 0, (size_t)b->n);     /* a record not read (refused, failed) is bad */
    verifier v = {b, h};
    int fatal = 0;
    Py_ssize_t nxt = 0;
    while ((nxt = aio_loop(ctx, ptrs, n, nxt, window, b->res, b->n, ev, &fatal, verify_record,
                           &v)) < n && !fatal) {
        /* The kernel's queue is full of others' requests: this one by hand. */
        struct iocb *cb = ptrs[nxt];
        ssize_t r = pread((int)cb->aio_fildes, (void *)(uintptr_t)cb->aio_buf,
                          (size_t)cb->aio_nbytes, (off_t)cb->aio_offset);
        b->res[cb->aio_data] = r < 0 ? -(int64_t)errno : r;
        verify_record(&v, cb);
        nxt++;
    }
    free(ptrs);
    free(ev);
    if (!fatal)
        fatal = __atomic_exchange_n(&fail_next, 0, __ATOMIC_RELAXED);
    return fatal;
}

static int get_array(PyObject *o, Py_buffer *v, Py_ssize_t n, const char *what)
{
    if (PyObject_GetBuffer(o, v, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (v->itemsize != 8 || (n >= 0 && v->len != n * 8)) {
        PyErr_Format(PyExc_ValueError, "Batch: %s must be %zd 8-byte integers", what, n);
        PyBuffer_Release(v);
        return -1;
    }
    return 0;
}

static void Batch_dealloc(Batch *b)
{
    free(b->cbs);
    free(b->res);
    free(b->want);
    free(b->ok);
    Py_TYPE(b)->tp_free((PyObject *)b);
}

/* 1 when a row is named twice, -1 out of memory. Each record is verified as its read is
 * reaped, so of two records read into one row both would pass while the row holds only the
 * one that landed last (rev11's review; the Python fallback hashes the rows after all the
 * reads and fails the first): such a batch is refused. An open-addressing set of the rows
 * (they are >= 0, so -1 is free), on the stack for a get's batch. */
static int rows_repeat(const int64_t *rw, Py_ssize_t n)
{
    int64_t local[256], *set = local;
    size_t cap = 16;
    int bits = 4;
    while (cap < 2 * (size_t)n) {
        cap <<= 1;
        bits++;
    }
    if (cap > sizeof local / sizeof *local && (set = malloc(cap * sizeof *set)) == NULL)
        return -1;
    memset(set, 0xff, cap * sizeof *set);
    int rep = 0;
    for (Py_ssize_t i = 0; i < n && !rep; i++) {
        size_t h = (size_t)(((uint64_t)rw[i] * 0x9E3779B97F4A7C15ull) >> (64 - bits));
        while (set[h] != -1 && set[h] != rw[i])
            h = (h + 1) & (cap - 1);
        rep = set[h] == rw[i];
        set[h] = rw[i];
    }
    if (set != local)
        free(set);
    return rep;
}

static PyObject *Batch_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    (void)kw;
    PyObject *a_tab, *a_segs, *a_offs, *a_rows, *a_sums, *a_into;
    long long nbytes;
    if (!PyArg_ParseTuple(args, "OOOOOLO", &a_tab, &a_segs, &a_offs, &a_rows, &a_into, &nbytes,
                          &a_sums))
        return NULL;
    /* The destination's address and layout from its buffer (numpy's .ctypes costs ~3 us a
     * call); its memory outlives the batch (a host pool's, the slots pinned by the caller). */
    Py_buffer into;
    if (PyObject_GetBuffer(a_into, &into, PyBUF_WRITABLE | PyBUF_STRIDES) < 0)
        return NULL;
    uint64_t base = (uint64_t)(uintptr_t)into.buf;
    Py_ssize_t stride = into.ndim == 2 ? into.strides[0] : 0;
    Py_ssize_t nrows = into.ndim == 2 ? into.shape[0] : 0;
    int fits = into.ndim == 2 && into.itemsize == 1 && into.strides[1] == 1
               && into.shape[1] == nbytes;
    PyBuffer_Release(&into);
    if (!fits || base % ALIGN || stride <= 0 || stride % ALIGN || nbytes <= 0
        || nbytes % ALIGN) {
        PyErr_SetString(PyExc_BufferError, "Batch: the destination must be a 2-D byte array of "
                        "4 KiB-aligned rows of nbytes (a multiple of 4 KiB)");
        return NULL;
    }
    Py_buffer tab, segs, offs, rows, sums;
    if (get_array(a_tab, &tab, -1, "segtab") < 0)
        return NULL;
    if (tab.len % 32) {
        PyErr_SetString(PyExc_ValueError, "Batch: segtab must be (k, 4) int64");
        PyBuffer_Release(&tab);
        return NULL;
    }
    if (get_array(a_segs, &segs, -1, "segs") < 0) {
        PyBuffer_Release(&tab);
        return NULL;
    }
    Py_ssize_t n = segs.len / 8, k = tab.len / 32;
    int got = 1;
    if (get_array(a_offs, &offs, n, "offs") < 0)
        got = 0;
    else if (get_array(a_rows, &rows, n, "rows") < 0) {
        PyBuffer_Release(&offs);
        got = 0;
    } else if (get_array(a_sums, &sums, n, "sums") < 0) {
        PyBuffer_Release(&offs);
        PyBuffer_Release(&rows);
        got = 0;
    }
    if (!got) {
        PyBuffer_Release(&tab);
        PyBuffer_Release(&segs);
        return NULL;
    }
    Batch *b = NULL;
    const int64_t *t = tab.buf, *sg = segs.buf, *of = offs.buf, *rw = rows.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (rw[i] < 0 || rw[i] >= nrows) {
            PyErr_Format(PyExc_IndexError, "Batch: row %lld outside the %zd of the array",
                         (long long)rw[i], nrows);
            goto done;
        }
    }
    int rep = rows_repeat(rw, n);
    if (rep) {
        if (rep < 0)
            PyErr_NoMemory();
        else
            PyErr_SetString(PyExc_ValueError, "Batch: a row named twice (each record is "
                            "verified as it lands: its row must hold it alone)");
        goto done;
    }
    b = (Batch *)type->tp_alloc(type, 0);
    if (b == NULL)
        goto done;
    b->n = n;
    b->nbytes = nbytes;
    b->cbs = calloc((size_t)(n ? n : 1), sizeof *b->cbs);
    b->res = calloc((size_t)(n ? n : 1), sizeof *b->res);
    b->want = malloc((size_t)(n ? n : 1) * sizeof *b->want);
    b->ok = calloc((size_t)(n ? n : 1), 1);
    if (!b->cbs || !b->res || !b->want || !b->ok) {
        Py_CLEAR(b);
        PyErr_NoMemory();
        goto done;
    }
    memcpy(b->want, sums.buf, (size_t)n * 8);
    Py_ssize_t m = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        const int64_t *s = NULL;
        for (Py_ssize_t j = 0; j < k; j++) {
            if (t[4 * j] == sg[i]) {
                s = &t[4 * j];
                break;
            }
        }
        if (s == NULL || s[1] < 0 || s[2] < 0)
            continue;                     /* its segment is gone: a bad record */
        if (of[i] < 0 || of[i] > (INT64_MAX - nbytes) / ALIGN)
            continue;                     /* past any file (its byte offset would overflow) */
        int64_t off = of[i] * ALIGN, start = s[2], size = s[3];
        if (off < start || (off - start) % nbytes || off + nbytes > size)
            continue;                     /* outside what was written */
        struct iocb *cb = &b->cbs[m++];
        cb->aio_data = (uint64_t)i;
        cb->aio_lio_opcode = IOCB_CMD_PREAD;
        cb->aio_fildes = (uint32_t)s[1];
        cb->aio_buf = base + (uint64_t)rw[i] * (uint64_t)stride;
        cb->aio_nbytes = (uint64_t)nbytes;
        cb->aio_offset = off;
    }
    b->nreq = m;
    qsort(b->cbs, (size_t)m, sizeof *b->cbs, cmp_cb);
done:
    PyBuffer_Release(&tab);
    PyBuffer_Release(&segs);
    PyBuffer_Release(&offs);
    PyBuffer_Release(&rows);
    PyBuffer_Release(&sums);
    return (PyObject *)b;
}

static PyObject *Batch_run(Batch *b, PyObject *args)
{
    unsigned long ctx;
    long window;
    PyObject *fn;
    if (!PyArg_ParseTuple(args, "klO", &ctx, &window, &fn))
        return NULL;
    xxh3_fn h = (xxh3_fn)PyLong_AsVoidPtr(fn);
    if (h == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "Batch.run: no XXH3 function");
        return NULL;
    }
    if (window < 1 || b->queued) {
        PyErr_SetString(PyExc_ValueError, "Batch.run: window < 1, or the batch is queued");
        return NULL;
    }
    int err;
    b->ran = 0;         /* a re-run's verdicts are its own: none until it succeeds (rev5) */
    Py_BEGIN_ALLOW_THREADS
    err = batch_read(b, (aio_context_t)ctx, window, h);
    if (err)
        syscall(SYS_io_destroy, (aio_context_t)ctx);   /* waits for what is in flight */
    Py_END_ALLOW_THREADS
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    b->ran = 1;
    Py_RETURN_NONE;
}

static PyObject *Batch_ok(Batch *b, PyObject *Py_UNUSED(ignored))
{
    if (!b->ran || b->queued) {
        PyErr_SetString(PyExc_RuntimeError, "Batch.ok: the batch has not been read");
        return NULL;
    }
    return PyBytes_FromStringAndSize((const char *)b->ok, b->n);
}

static PyObject *Batch_requests(Batch *b, void *Py_UNUSED(c))
{
    return PyLong_FromSsize_t(b->nreq);
}

static PyMethodDef Batch_methods[] = {
    {"run", (PyCFunction)Batch_run, METH_VARARGS, "run(ctx, window, xxh3): the read, GIL released"},
    {"ok", (PyCFunction)Batch_ok, METH_NOARGS, "per record 1 read and verified, else 0"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Batch_getset[] = {
    {"requests", (getter)Batch_requests, NULL, "records that will be read", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject BatchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier.tiers._reads.Batch",
    .tp_basicsize = sizeof(Batch),
    .tp_dealloc = (destructor)Batch_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One NVMe read of records into host slots, verified (see _reads.c).",
    .tp_methods = Batch_methods,
    .tp_getset = Batch_getset,
    .tp_new = Batch_new,
};

/* ------------------------------------------------------------------ the reader threads */

typedef struct job {
    struct job *next;
    Batch *batch;           /* a reference, taken by submit, given back by reap */
    PyObject *token;        /* likewise */
    int err;
} job;

typedef struct Reader Reader;

typedef struct {
    Reader *r;
    pthread_t tid;
    aio_context_t ctx;
    int started;
} worker;

struct Reader {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t cv;
    job *todo, *todo_tail, *done;
    int nthreads, stop, closed, efd;
    long depth;
    xxh3_fn h;
    worker *w;
};

/* A finished job onto the done list; the eventfd is written after the mutex is released
 * (the write is a syscall the other workers and the reaper would wait for) and only by the
 * worker that found the list empty: the jobs pushed after it ride on its wake. No wake is
 * lost: that write comes after its push, and the reaper reads the eventfd before it takes
 * the list, so either the reaper's take comes after the push (and takes the job) or its read
 * comes before the write (and the write wakes it again). A take that finds the list empty
 * (a write seen after its job was taken) is a spurious wake, no more (issue 17, fio11). */
static void finish_job(Reader *r, job *j)
{
    pthread_mutex_lock(&r->mu);
    int first = r->done == NULL;
    j->next = r->done;
    r->done = j;
    pthread_mutex_unlock(&r->mu);
    if (first) {
        uint64_t one = 1;
        ssize_t wr = write(r->efd, &one, sizeof one);
        (void)wr;                                   /* only fails when the count is huge */
    }
}

static void *worker_main(void *arg)
{
    worker *w = arg;
    Reader *r = w->r;
    for (;;) {
        pthread_mutex_lock(&r->mu);
        while (r->todo == NULL && !r->stop)
            pthread_cond_wait(&r->cv, &r->mu);
        job *j = r->todo;
        if (j == NULL) {
            pthread_mutex_unlock(&r->mu);
            break;                                  /* stopping, and nothing is left */
        }
        r->todo = j->next;
        if (r->todo == NULL)
            r->todo_tail = NULL;
        pthread_mutex_unlock(&r->mu);
        if (w->ctx == 0 && syscall(SYS_io_setup, r->depth, &w->ctx) < 0) {
            w->ctx = 0;
            j->err = errno;
        } else {
            j->err = batch_read(j->batch, w->ctx, r->depth, r->h);
            if (j->err) {
                syscall(SYS_io_destroy, w->ctx);     /* waits for what is in flight */
                w->ctx = 0;                         /* a fresh one for the next batch */
            }
        }
        finish_job(r, j);
    }
    return NULL;
}

static void reader_stop(Reader *r)
{
    if (r->closed)
        return;
    r->closed = 1;
    pthread_mutex_lock(&r->mu);
    r->stop = 1;
    pthread_cond_broadcast(&r->cv);
    pthread_mutex_unlock(&r->mu);
    Py_BEGIN_ALLOW_THREADS
    for (int i = 0; i < r->nthreads; i++) {
        if (r->w[i].started)
            pthread_join(r->w[i].tid, NULL);
        if (r->w[i].ctx)
            syscall(SYS_io_destroy, r->w[i].ctx);
    }
    Py_END_ALLOW_THREADS
    /* Every queued batch ran (the threads drain the queue before they stop). */
    for (job *j = r->done, *nx; j; j = nx) {
        nx = j->next;
        j->batch->queued = 0;
        Py_DECREF(j->batch);
        Py_DECREF(j->token);
        free(j);
    }
    r->done = NULL;
    if (r->efd >= 0)
        close(r->efd);
    r->efd = -1;
}

static void Reader_dealloc(Reader *r)
{
    if (r->w != NULL)
        reader_stop(r);
    free(r->w);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    Py_TYPE(r)->tp_free((PyObject *)r);
}

static PyObject *Reader_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    (void)kw;
    int threads;
    long depth;
    PyObject *fn;
    if (!PyArg_ParseTuple(args, "ilO", &threads, &depth, &fn))
        return NULL;
    xxh3_fn h = (xxh3_fn)PyLong_AsVoidPtr(fn);
    if (h == NULL) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "Reader: no XXH3 function");
        return NULL;
    }
    if (threads < 1 || threads > 64 || depth < 1) {
        PyErr_SetString(PyExc_ValueError, "Reader: 1-64 threads, depth >= 1");
        return NULL;
    }
    Reader *r = (Reader *)type->tp_alloc(type, 0);
    if (r == NULL)
        return NULL;
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    r->efd = -1;
    r->h = h;
    r->depth = depth;
    r->nthreads = threads;
    r->w = calloc((size_t)threads, sizeof *r->w);
    if (r->w == NULL) {
        Py_DECREF(r);
        return PyErr_NoMemory();
    }
    r->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (r->efd < 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        Py_DECREF(r);
        return NULL;
    }
    for (int i = 0; i < threads; i++) {
        r->w[i].r = r;
        /* The contexts now, so that a host-wide fs.aio-max-nr refusal is known here. */
        if (syscall(SYS_io_setup, depth, &r->w[i].ctx) < 0) {
            r->w[i].ctx = 0;
            PyErr_SetFromErrno(PyExc_OSError);
            Py_DECREF(r);
            return NULL;
        }
        int e = pthread_create(&r->w[i].tid, NULL, worker_main, &r->w[i]);
        if (e) {
            errno = e;
            PyErr_SetFromErrno(PyExc_OSError);
            Py_DECREF(r);
            return NULL;
        }
        r->w[i].started = 1;
    }
    return (PyObject *)r;
}

static PyObject *Reader_submit(Reader *r, PyObject *args)
{
    PyObject *b, *token;
    if (!PyArg_ParseTuple(args, "O!O", &BatchType, &b, &token))
        return NULL;
    Batch *bt = (Batch *)b;
    if (r->closed) {
        PyErr_SetString(PyExc_ValueError, "Reader.submit: the reader is closed");
        return NULL;
    }
    if (bt->queued) {
        PyErr_SetString(PyExc_ValueError, "Reader.submit: the batch is queued already");
        return NULL;
    }
    job *j = calloc(1, sizeof *j);
    if (j == NULL)
        return PyErr_NoMemory();
    bt->queued = 1;
    bt->ran = 0;        /* as in Batch.run: an earlier run's verdicts are not this one's */
    Py_INCREF(b);
    Py_INCREF(token);
    j->batch = bt;
    j->token = token;
    pthread_mutex_lock(&r->mu);
    if (r->todo_tail)
        r->todo_tail->next = j;
    else
        r->todo = j;
    r->todo_tail = j;
    pthread_cond_signal(&r->cv);
    pthread_mutex_unlock(&r->mu);
    Py_RETURN_NONE;
}

static PyObject *Reader_reap(Reader *r, PyObject *Py_UNUSED(ignored))
{
    if (r->closed)
        return PyList_New(0);
    uint64_t cnt;
    ssize_t rd = read(r->efd, &cnt, sizeof cnt);    /* EAGAIN: nothing since the last */
    (void)rd;
    pthread_mutex_lock(&r->mu);
    job *j = r->done;
    r->done = NULL;
    pthread_mutex_unlock(&r->mu);
    /* Oldest first (the list was pushed at its head). */
    job *rev = NULL;
    while (j) {
        job *nx = j->next;
        j->next = rev;
        rev = j;
        j = nx;
    }
    PyObject *out = PyList_New(0);
    for (j = rev; j; ) {
        job *nx = j->next;
        j->batch->queued = 0;
        if (!j->err)
            j->batch->ran = 1;
        PyObject *t = out ? Py_BuildValue("(Oi)", j->token, j->err) : NULL;
        if (t == NULL || PyList_Append(out, t) < 0)
            Py_CLEAR(out);
        Py_XDECREF(t);
        Py_DECREF(j->batch);
        Py_DECREF(j->token);
        free(j);
        j = nx;
    }
    return out;
}

static PyObject *Reader_close(Reader *r, PyObject *Py_UNUSED(ignored))
{
    reader_stop(r);
    Py_RETURN_NONE;
}

static PyObject *Reader_fd(Reader *r, void *Py_UNUSED(c))
{
    return PyLong_FromLong(r->efd);
}

static PyMethodDef Reader_methods[] = {
    {"submit", (PyCFunction)Reader_submit, METH_VARARGS, "submit(batch, token): queue a read"},
    {"reap", (PyCFunction)Reader_reap, METH_NOARGS, "[(token, errno)] of the reads done"},
    {"close", (PyCFunction)Reader_close, METH_NOARGS, "finish the queue, stop the threads"},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Reader_getset[] = {
    {"fd", (getter)Reader_fd, NULL, "the eventfd, readable when a read is done", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvtier.tiers._reads.Reader",
    .tp_basicsize = sizeof(Reader),
    .tp_dealloc = (destructor)Reader_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "C threads that run Batches and signal an eventfd (see _reads.c).",
    .tp_methods = Reader_methods,
    .tp_getset = Reader_getset,
    .tp_new = Reader_new,
};

static PyObject *fail_next_read(PyObject *Py_UNUSED(m), PyObject *arg)
{
    long e = PyLong_AsLong(arg);
    if (e == -1 && PyErr_Occurred())
        return NULL;
    if (e < 0 || e > 4095) {
        PyErr_SetString(PyExc_ValueError, "_fail_next_read: an errno (0: none)");
        return NULL;
    }
    __atomic_store_n(&fail_next, (int)e, __ATOMIC_RELAXED);
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"_fail_next_read", fail_next_read, METH_O,
     "tests only: the next read lands its bytes, then fails with this errno (0: none)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_reads",
    "An NVMe get's whole read (AIO, checksums, verdicts) in C, and threads that run it.",
    -1, module_methods,
};

PyMODINIT_FUNC PyInit__reads(void)
{
    if (PyType_Ready(&BatchType) < 0 || PyType_Ready(&ReaderType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&BatchType);
    Py_INCREF(&ReaderType);
    if (PyModule_AddObject(m, "Batch", (PyObject *)&BatchType) < 0
        || PyModule_AddObject(m, "Reader", (PyObject *)&ReaderType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
