/* kvtier.tiers._aio: the submit/reap loop of tiers/aio.py in C.
 *
 * Why. The Python loop costs 20-40 us per turn on the 2-core development VM (two ctypes
 * syscalls and a few numpy calls), and a turn happens for every completion that frees a place
 * in the window; this is the same loop with the GIL released, as fio's libaio engine runs it.
 * Measured on that VM, bench/nvme.py gained nothing clear from it (the disk was the limit);
 * what it does add is error handling the kernel's contract needs, below. tiers/aio.py keeps
 * the Python loop as the fallback where this module was not built; tests run both.
 *
 * The loop itself is aio_loop.h's (shared with _reads.c).
 *
 * Contract (the caller in aio.py builds the arguments and checks them):
 *   run(ctx, iocbs, out, first, window) -> int
 *       ctx: an io_setup context of at least `window` events. iocbs: n struct iocb, filled in
 *       by the caller, each with aio_data set to its own index. out: n int64, where the result
 *       of each request lands (bytes moved, or -errno). Requests first..n-1 are submitted with
 *       at most `window` in flight. A request that io_submit refuses outright (EBADF, EINVAL)
 *       gets -errno in out and the rest go on. Returns n when all are done, or the index of the
 *       first request not submitted when the kernel's queue refused one with nothing in flight
 *       (EAGAIN): the caller runs that one synchronously and calls again. Nothing is in flight
 *       when it returns. An io_getevents failure other than EINTR raises OSError and leaves
 *       requests in flight: the caller must io_destroy the context, which waits for them,
 *       before it frees any buffer.
 *   write_run(ctx, window, fd, offset, addrs, nbytes, per, out) -> None
 *       A run of records consecutive in the file (an NVMe append's chunk: tiers/nvme.py): n
 *       = len(addrs) buffers of nbytes each (addrs int64, their addresses) written to fd from
 *       `offset` on, as PWRITEVs of `per` consecutive buffers (the last of the rest), their
 *       iovecs and iocbs built here. out: int64, one per request (ceil(n / per)): the bytes
 *       it wrote, or -errno. A request the kernel's queue refuses with nothing in flight is
 *       written by pwritev on this thread. The caller keeps the buffers alive (and aligned,
 *       for O_DIRECT). OSError as for run (the caller destroys the context). Why (issue 17,
 *       fio10): the iocbs and iovecs built by numpy from Python lists were ~0.06 ms of a
 *       16-block put's ~0.8 ms of CPU on the dev VM.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <linux/aio_abi.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include "aio_loop.h"

static PyObject *run(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "run(ctx, iocbs, out, first, window)");
        return NULL;
    }
    unsigned long ctx = PyLong_AsUnsignedLong(args[0]);
    Py_ssize_t first = PyLong_AsSsize_t(args[3]);
    long window = PyLong_AsLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer cbs, out;
    if (PyObject_GetBuffer(args[1], &cbs, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[2], &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&cbs);
        return NULL;
    }
    Py_ssize_t n = cbs.len / (Py_ssize_t)sizeof(struct iocb);
    PyObject *result = NULL;
    struct iocb **ptrs = NULL;
    struct io_event *ev = NULL;
    if (cbs.len % (Py_ssize_t)sizeof(struct iocb) || out.len != n * (Py_ssize_t)sizeof(int64_t)
        || first < 0 || first > n || window < 1) {
        PyErr_SetString(PyExc_ValueError, "iocbs, out, first or window do not agree");
        goto done;
    }
    ptrs = malloc((size_t)(n ? n : 1) * sizeof *ptrs);
    ev = malloc((size_t)window * sizeof *ev);
    if (ptrs == NULL || ev == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    struct iocb *cb = cbs.buf;
    int64_t *res = out.buf;
    for (Py_ssize_t i = 0; i < n; i++)
        ptrs[i] = &cb[i];

    Py_ssize_t nxt;
    int fatal;
    Py_BEGIN_ALLOW_THREADS
    nxt = aio_loop((aio_context_t)ctx, ptrs, n, first, window, res, n, ev, &fatal, NULL, NULL);
    Py_END_ALLOW_THREADS
    if (fatal) {
        errno = fatal;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    result = PyLong_FromSsize_t(nxt);
done:
    free(ptrs);
    free(ev);
    PyBuffer_Release(&cbs);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *write_run(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError,
                        "write_run(ctx, window, fd, offset, addrs, nbytes, per, out)");
        return NULL;
    }
    unsigned long ctx = PyLong_AsUnsignedLong(args[0]);
    long window = PyLong_AsLong(args[1]);
    int fd = (int)PyLong_AsLong(args[2]);
    long long offset = PyLong_AsLongLong(args[3]);
    long long nbytes = PyLong_AsLongLong(args[5]);
    Py_ssize_t per = PyLong_AsSsize_t(args[6]);
    if (PyErr_Occurred())
        return NULL;
    Py_buffer addrs, out;
    if (PyObject_GetBuffer(args[4], &addrs, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[7], &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&addrs);
        return NULL;
    }
    PyObject *result = NULL;
    struct iovec *iov = NULL;
    struct iocb *cbs = NULL, **ptrs = NULL;
    struct io_event *ev = NULL;
    Py_ssize_t n = addrs.len / 8, nreq = per > 0 ? (n + per - 1) / per : 0;
    if (addrs.itemsize != 8 || addrs.len % 8 || n == 0 || per < 1 || per > 1024 || fd < 0
        || offset < 0 || nbytes <= 0 || window < 1
        || out.len != nreq * (Py_ssize_t)sizeof(int64_t)) {
        PyErr_SetString(PyExc_ValueError, "write_run: addrs, fd, offset, nbytes, per, window "
                        "or out do not agree");
        goto done;
    }
    iov = malloc((size_t)n * sizeof *iov);
    cbs = calloc((size_t)nreq, sizeof *cbs);
    ptrs = malloc((size_t)nreq * sizeof *ptrs);
    ev = malloc((size_t)window * sizeof *ev);
    if (!iov || !cbs || !ptrs || !ev) {
        PyErr_NoMemory();
        goto done;
    }
    const int64_t *at = addrs.buf;
    int64_t *res = out.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        iov[i].iov_base = (void *)(uintptr_t)at[i];
        iov[i].iov_len = (size_t)nbytes;
    }
    for (Py_ssize_t k = 0; k < nreq; k++) {
        Py_ssize_t first = k * per, count = n - first < per ? n - first : per;
        cbs[k].aio_data = (uint64_t)k;
        cbs[k].aio_lio_opcode = IOCB_CMD_PWRITEV;
        cbs[k].aio_fildes = (uint32_t)fd;
        cbs[k].aio_buf = (uint64_t)(uintptr_t)&iov[first];
        cbs[k].aio_nbytes = (uint64_t)count;
        cbs[k].aio_offset = offset + (long long)first * nbytes;
        ptrs[k] = &cbs[k];
        res[k] = 0;
    }
    int fatal = 0;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t nxt = 0;
    while ((nxt = aio_loop((aio_context_t)ctx, ptrs, nreq, nxt, window, res, nreq, ev, &fatal,
                           NULL, NULL)) < nreq && !fatal) {
        /* The kernel's queue is full of others' requests: this one by hand. */
        struct iocb *cb = ptrs[nxt];
        ssize_t r = pwritev(fd, (const struct iovec *)(uintptr_t)cb->aio_buf,
                            (int)cb->aio_nbytes, (off_t)cb->aio_offset);
        res[cb->aio_data] = r < 0 ? -(int64_t)errno : r;
        nxt++;
    }
    Py_END_ALLOW_THREADS
    if (fatal) {
        errno = fatal;
        PyErr_SetFromErrno(PyExc_OSError);
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    free(iov);
    free(cbs);
    free(ptrs);
    free(ev);
    PyBuffer_Release(&addrs);
    PyBuffer_Release(&out);
    return result;
}

static PyMethodDef methods[] = {
    {"run", (PyCFunction)(void (*)(void))run, METH_FASTCALL,
     "run(ctx, iocbs, out, first, window): submit and reap a batch of iocbs (see _aio.c)."},
    {"write_run", (PyCFunction)(void (*)(void))write_run, METH_FASTCALL,
     "write_run(ctx, window, fd, offset, addrs, nbytes, per, out): a run of records as "
     "PWRITEVs (see _aio.c)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_aio",
    "The native AIO submit/reap loop of tiers/aio.py in C (see _aio.c).", -1, methods,
};

PyMODINIT_FUNC PyInit__aio(void)
{
    return PyModule_Create(&module);
}
