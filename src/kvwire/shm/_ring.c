/* kvwire.shm._ring: the per-message hot path of kvwire.shm.MessageQueue, in C.
 *
 * Optional accelerator. queue.py uses it when it imports (and KVWIRE_SHM_PURE is not
 * set); otherwise the pure-Python path does the same steps (see docs/shm.md).
 *
 *   Writer.put(obj[, timeout])  pickle obj, copy it into the next chunk, publish it, wake
 *                               sleeping readers. Returns None when published; otherwise
 *                               (main, bufs) for queue.py's slow path (ring still full after
 *                               a short spin, liveness check due, larger than a chunk,
 *                               out-of-band buffers), or SLOW for bytes >= raw_min (sent
 *                               without pickle by the slow path).
 *   Reader.get([timeout])       wait briefly for the next message; if it is a single pickle
 *                               frame, copy it out, hand the chunk back, wake the writer if
 *                               it sleeps, unpickle the copy and return it. Otherwise return
 *                               SLOW, with the reason in .why (NOT_READY, NOT_SIMPLE, TORN).
 *
 * The writer's wseq/min_rseq/next_check and the reader's rseq live in these objects (as
 * attributes), so queue.py's slow paths and these fast paths share one copy of the state.
 *
 * Memory ordering, with GCC/Clang __atomic builtins (C11 memory model), so it holds on
 * weakly ordered CPUs (aarch64) as well as on x86-64:
 *   writer: payload + meta (plain/relaxed stores)  ->  seq = s+1 (RELEASE store)
 *   reader: seq == s+1 (ACQUIRE load)  ->  meta + payload copy  ->  ACQUIRE fence  ->
 *           re-load seq (still s+1, else the chunk was reused: TORN)  ->
 *           rseq = s+1 (RELEASE store: our payload reads happen before the writer reuses it)
 *   writer, reusing a chunk: rseq of every live reader (ACQUIRE loads) before writing.
 * Sleep handshake (Dekker: "store my word, then load the peer's sleeping flag"): with
 * `asymmetric` (this process registered for membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED)
 * and sleepers call it after setting their flag), the publishing side needs only a
 * compiler barrier between its store and its load; otherwise a seq_cst fence.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <sched.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>
#include <linux/futex.h>

#include "_pickle5.h"

#ifndef __linux__
#error "kvwire.shm._ring needs Linux (futex, membarrier)"
#endif
#ifndef SYS_membarrier
#if defined(__x86_64__)
#define SYS_membarrier 324
#elif defined(__aarch64__) || defined(__riscv)
#define SYS_membarrier 283
#endif
#endif
#define MEMBARRIER_GLOBAL_EXPEDITED 2 /* linux/membarrier.h: MEMBARRIER_CMD_GLOBAL_EXPEDITED */

/* ---- ring layout: must match layout.py (queue.py compares LAYOUT at import) ---- */
#define LAYOUT_VERSION 1
#define LINE 64
#define OFF_WRITER_STATE 52
#define OFF_RWAKE (1 * LINE)
#define OFF_WWAKE (2 * LINE)
#define OFF_WRITER_SLEEPING (2 * LINE + 8)
#define OFF_SLEEPERS (3 * LINE)
#define OFF_READERS (4 * LINE)
#define R_SEQ 0
#define R_STATUS 12
#define R_DROPPED 2
#define R_CLOSED 3
#define W_SHUTDOWN 2
#define CHUNK_HDR LINE
#define C_SEQ 0
#define C_META 16
#define F_SINGLE 1
#define SINGLE_HI ((uint64_t)F_SINGLE | (1u << 8)) /* meta >> 40 of a one-frame message */
#define MASK40 ((UINT64_C(1) << 40) - 1)
#define MAX_READERS 64

#define WHY_NOT_READY 1  /* nothing published yet (or the writer shut down): wait in Python */
#define WHY_NOT_SIMPLE 2 /* fragment, frame table, raw chunk or a big frame: Python reads it */
#define WHY_TORN 3       /* the chunk was reused while we copied it: we were dropped */

#define YIELD_AFTER_NS 50000 /* spin this long, then also sched_yield (as queue.py does) */
#define LIVENESS_EVERY 64    /* the writer reads the clock every 64th message */

static PyObject *SLOW;           /* sentinel: "take queue.py's slow path" */
static PyObject *kw_buffer_cb;   /* ("buffer_callback",) */
static PyObject *protocol5;      /* 5 */

/* ---------------------------------------------------------------- primitives */
static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield" ::: "memory");
#else
    __asm__ __volatile__("" ::: "memory");
#endif
}

static inline int64_t mono_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts); /* the clock of Python's time.monotonic() */
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Store->load fence of the publishing side of the sleep handshake. */
static inline void publish_fence(int asym) {
    if (asym)
        __atomic_signal_fence(__ATOMIC_SEQ_CST); /* membarrier() on the sleeping side */
    else
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

static long futex_wake_raw(uint32_t *addr, int n) {
    return syscall(SYS_futex, addr, FUTEX_WAKE, n, NULL, NULL, 0);
}

/* Bump a futex word and wake everyone sleeping on it. */
static void bump_and_wake(uint32_t *word) {
    __atomic_fetch_add(word, 1, __ATOMIC_SEQ_CST);
    futex_wake_raw(word, INT_MAX);
}

static int64_t budget_ns(int64_t spin_ns, PyObject *timeout) {
    if (timeout == NULL || timeout == Py_None)
        return spin_ns;
    double t = PyFloat_AsDouble(timeout);
    if (t == -1.0 && PyErr_Occurred())
        return -1;
    if (!(t > 0))
        return 0;
    double ns = t * 1e9;
    return ns < (double)spin_ns ? (int64_t)ns : spin_ns;
}

/* ------------------------------------------------------------- shared base */
typedef struct {
    PyObject_HEAD
    Py_buffer view;   /* export of the mapping: keeps it mapped while we point into it */
    char *base;       /* NULL once released */
    uint64_t nchunks;
    uint64_t cbytes;
    Py_ssize_t hdr;   /* header size: chunk i starts at hdr + i * stride */
    Py_ssize_t stride;
    uint32_t nreader;
    int asym;
    int64_t spin_ns;
    int busy;            /* a thread sleeps with the GIL released and will touch the ring */
    int release_pending; /* release() came meanwhile: the sleeper releases when it wakes */
} RingBase;

static int base_init(RingBase *b, PyObject *mm, unsigned int n_reader,
                     unsigned long long cbytes, unsigned long long nchunks, Py_ssize_t hdr,
                     Py_ssize_t stride, int asym, double spin_s) {
    if (b->base != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "already initialized");
        return -1;
    }
    if (n_reader < 1 || n_reader > MAX_READERS || nchunks < 1 || cbytes < 1 ||
        hdr < OFF_READERS + (Py_ssize_t)n_reader * LINE || hdr % LINE || stride % LINE ||
        stride < CHUNK_HDR || (unsigned long long)(stride - CHUNK_HDR) < cbytes) {
        PyErr_SetString(PyExc_ValueError, "inconsistent ring geometry");
        return -1;
    }
    if (PyObject_GetBuffer(mm, &b->view, PyBUF_WRITABLE | PyBUF_SIMPLE) < 0)
        return -1;
    if ((uintptr_t)b->view.buf % LINE ||
        (unsigned long long)b->view.len < (unsigned long long)hdr + nchunks * (unsigned long long)stride) {
        PyBuffer_Release(&b->view);
        PyErr_SetString(PyExc_ValueError, "mapping too small or misaligned for this ring");
        return -1;
    }
    b->base = b->view.buf;
    b->nreader = n_reader;
    b->cbytes = cbytes;
    b->nchunks = nchunks;
    b->hdr = hdr;
    b->stride = stride;
    b->asym = asym;
    b->spin_ns = spin_s > 0 ? (int64_t)(spin_s * 1e9) : 0;
    return 0;
}

static void base_release(RingBase *b) {
    if (b->busy) {
        b->release_pending = 1;
        return;
    }
    if (b->base != NULL) {
        b->base = NULL;
        PyBuffer_Release(&b->view);
    }
}

static inline char *chunk_at(RingBase *b, uint64_t seq) {
    return b->base + b->hdr + (Py_ssize_t)(seq % b->nchunks) * b->stride;
}

static int check_open(RingBase *b) {
    if (b->base == NULL) {
        PyErr_SetString(PyExc_ValueError, "ring released (queue closed)");
        return -1;
    }
    return 0;
}

/* sched_yield with the GIL released, as os.sched_yield() does in queue.py's spin (other
 * threads of this process may run). -1 (error set) if the ring was released meanwhile. */
static int yield_gil(RingBase *b) {
    b->busy++;
    Py_BEGIN_ALLOW_THREADS
    sched_yield();
    Py_END_ALLOW_THREADS
    b->busy--;
    if (b->release_pending && !b->busy) {
        b->release_pending = 0;
        base_release(b);
        return check_open(b);
    }
    return 0;
}

static PyObject *base_release_meth(PyObject *self, PyObject *unused) {
    base_release((RingBase *)self);
    Py_RETURN_NONE;
}

static PyObject *get_u64(uint64_t v) { return PyLong_FromUnsignedLongLong(v); }

static int set_u64(uint64_t *dst, PyObject *v) {
    if (v == NULL) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete");
        return -1;
    }
    unsigned long long x = PyLong_AsUnsignedLongLong(v);
    if (x == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *dst = x;
    return 0;
}

/* ================================================================== Writer */
typedef struct {
    RingBase b;
    uint64_t wseq;       /* messages published */
    uint64_t min_rseq;   /* cached position of the slowest live reader */
    double next_check;   /* monotonic time of the next liveness check (set by queue.py) */
    Py_ssize_t raw_min;  /* bytes of this size or more skip pickle (slow path) */
    int fast;            /* use the pickle subset codec before pickle.dumps */
    PyObject *dumps;     /* pickle.dumps */
    PyObject *oob;       /* list: out-of-band buffers of the current message */
    PyObject *oob_append;
} WriterObject;

static int Writer_init(WriterObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"mm", "n_reader", "max_chunk_bytes", "max_chunks", "header_size",
                            "chunk_stride", "dumps", "asymmetric", "spin_s", "raw_min",
                            "fast_codec", NULL};
    PyObject *mm, *dumps;
    unsigned int n_reader;
    unsigned long long cbytes, nchunks;
    Py_ssize_t hdr, stride, raw_min = 4096;
    int asym, fast = 1;
    double spin_s;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OIKKnnOpd|np:Writer", names, &mm, &n_reader,
                                     &cbytes, &nchunks, &hdr, &stride, &dumps, &asym, &spin_s,
                                     &raw_min, &fast))
        return -1;
    if (!PyCallable_Check(dumps)) {
        PyErr_SetString(PyExc_TypeError, "dumps must be callable");
        return -1;
    }
    if (base_init(&self->b, mm, n_reader, cbytes, nchunks, hdr, stride, asym, spin_s) < 0)
        return -1;
    self->oob = PyList_New(0);
    self->oob_append = self->oob ? PyObject_GetAttrString(self->oob, "append") : NULL;
    if (self->oob_append == NULL) {
        base_release(&self->b);
        return -1;
    }
    Py_INCREF(dumps);
    self->dumps = dumps;
    self->raw_min = raw_min;
    self->fast = fast;
    self->wseq = self->min_rseq = 0;
    self->next_check = 0.0;
    return 0;
}

static void Writer_dealloc(WriterObject *self) {
    base_release(&self->b);
    Py_XDECREF(self->dumps);
    Py_XDECREF(self->oob_append);
    Py_XDECREF(self->oob);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Slowest live reader (wseq if none). A reader that dropped out (status DROPPED or
 * CLOSED, both final) does not count, exactly as queue.py's _refresh_min. */
static uint64_t writer_refresh_min(WriterObject *w) {
    uint64_t m = w->wseq;
    char *line = w->b.base + OFF_READERS;
    for (uint32_t i = 0; i < w->b.nreader; i++, line += LINE) {
        uint32_t st = __atomic_load_n((uint32_t *)(line + R_STATUS), __ATOMIC_RELAXED);
        if (st == R_DROPPED || st == R_CLOSED)
            continue;
        /* ACQUIRE: the reader's reads of the chunk happen before we overwrite it */
        uint64_t r = __atomic_load_n((uint64_t *)(line + R_SEQ), __ATOMIC_ACQUIRE);
        if (r < m)
            m = r;
    }
    w->min_rseq = m;
    return m;
}

/* Ring full by the cached minimum: re-read the readers, then spin (pause; after 50 us
 * also sched_yield) up to `budget` ns. Returns 1 when the chunk for wseq is free, 0 when
 * not, -1 (error set) when the queue was closed meanwhile. */
static int writer_make_room(WriterObject *w, int64_t budget) {
    uint64_t n = w->b.nchunks;
    if (w->wseq - writer_refresh_min(w) < n)
        return 1;
    if (budget <= 0)
        return 0;
    int64_t start = mono_ns(), end = start + budget, yield_after = start + YIELD_AFTER_NS;
    for (unsigned i = 1;; i++) {
        cpu_relax();
        if (w->wseq - writer_refresh_min(w) < n)
            return 1;
        if ((i & 7) == 0) {
            int64_t t = mono_ns();
            if (t >= end)
                return 0;
            if (t >= yield_after && yield_gil(&w->b) < 0)
                return -1;
        }
    }
}

static PyObject *slow_result(WriterObject *w, PyObject *main) {
    /* (main, bufs or None): queue.py writes it through its general path */
    PyObject *bufs = Py_None;
    Py_ssize_t k = PyList_GET_SIZE(w->oob);
    if (k) {
        bufs = PyList_GetSlice(w->oob, 0, k);
        if (bufs == NULL || PyList_SetSlice(w->oob, 0, k, NULL) < 0) {
            Py_XDECREF(bufs);
            Py_DECREF(main);
            return NULL;
        }
    } else {
        Py_INCREF(bufs);
    }
    PyObject *r = PyTuple_New(2);
    if (r == NULL) {
        Py_DECREF(main);
        Py_DECREF(bufs);
        return NULL;
    }
    PyTuple_SET_ITEM(r, 0, main);
    PyTuple_SET_ITEM(r, 1, bufs);
    return r;
}

PyDoc_STRVAR(Writer_put_doc,
"put(obj, timeout=None) -> None | (main, bufs) | SLOW\n\n"
"Pickle obj (protocol 5, out-of-band buffers collected) and publish it in the next chunk.\n"
"None: published (and sleeping readers woken). (main, bufs): not published, write this\n"
"pickle (bufs: list of PickleBuffer or None) through the slow path. SLOW: obj is bytes of\n"
"raw_min or more, not pickled. `timeout` only caps the spin on a full ring.");

static PyObject *Writer_put(WriterObject *w, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "put(obj, timeout=None)");
        return NULL;
    }
    if (check_open(&w->b) < 0)
        return NULL;
    PyObject *obj = args[0];
    if (PyBytes_CheckExact(obj) && PyBytes_GET_SIZE(obj) >= w->raw_min) {
        Py_INCREF(SLOW);
        return SLOW;
    }
    uint64_t wseq = w->wseq;
    int ok = 1; /* may publish now: a free chunk, no liveness check due */
    if (wseq - w->min_rseq >= w->b.nchunks) {
        int64_t budget = budget_ns(w->b.spin_ns, nargs > 1 ? args[1] : NULL);
        if (budget < 0)
            return NULL;
        ok = writer_make_room(w, budget); /* may release the GIL (yield) */
        if (ok < 0)
            return NULL;
        if (w->wseq != wseq) /* another thread enqueued meanwhile: let Python sort it out */
            ok = 0;
    }
    if (ok && (wseq & (LIVENESS_EVERY - 1)) == 0 && (double)mono_ns() * 1e-9 >= w->next_check)
        ok = 0;
    char *chunk = chunk_at(&w->b, wseq);
    Py_ssize_t n = -1;
    if (ok && w->fast)
        n = kvw_p5_dumps_into(obj, (unsigned char *)chunk + CHUNK_HDR, (Py_ssize_t)w->b.cbytes);
    if (n < 0) {
        PyObject *call_args[3] = {obj, protocol5, w->oob_append};
        PyObject *main = PyObject_Vectorcall(w->dumps, call_args, 2, kw_buffer_cb);
        if (main == NULL) {
            PyList_SetSlice(w->oob, 0, PyList_GET_SIZE(w->oob), NULL);
            return NULL;
        }
        if (!PyBytes_CheckExact(main)) {
            Py_DECREF(main);
            PyList_SetSlice(w->oob, 0, PyList_GET_SIZE(w->oob), NULL);
            PyErr_SetString(PyExc_TypeError, "dumps() did not return bytes");
            return NULL;
        }
        /* pickle.dumps may have run Python code (__reduce__, GC), and with it other
         * threads: the queue may be closed, or wseq moved on. Re-check before writing. */
        if (w->b.base == NULL || w->wseq != wseq)
            ok = 0;
        n = PyBytes_GET_SIZE(main);
        if (!ok || PyList_GET_SIZE(w->oob) || (uint64_t)n > w->b.cbytes)
            return slow_result(w, main);
        chunk = chunk_at(&w->b, wseq);
        memcpy(chunk + CHUNK_HDR, PyBytes_AS_STRING(main), (size_t)n);
        Py_DECREF(main);
    }
    __atomic_store_n((uint64_t *)(chunk + C_META), (uint64_t)n | (SINGLE_HI << 40),
                     __ATOMIC_RELAXED);
    /* the publishing store: payload and meta become visible no later than it */
    __atomic_store_n((uint64_t *)(chunk + C_SEQ), wseq + 1, __ATOMIC_RELEASE);
    w->wseq = wseq + 1;
    publish_fence(w->b.asym);
    const uint64_t *flags = (const uint64_t *)(w->b.base + OFF_SLEEPERS);
    for (uint32_t i = 0; i < (w->b.nreader + 7) / 8; i++) {
        if (__atomic_load_n(flags + i, __ATOMIC_RELAXED)) {
            bump_and_wake((uint32_t *)(w->b.base + OFF_RWAKE));
            break;
        }
    }
    Py_RETURN_NONE;
}

static PyObject *Writer_refresh(WriterObject *w, PyObject *unused) {
    if (check_open(&w->b) < 0)
        return NULL;
    return get_u64(writer_refresh_min(w));
}

static PyObject *W_get_wseq(WriterObject *w, void *c) { return get_u64(w->wseq); }
static int W_set_wseq(WriterObject *w, PyObject *v, void *c) { return set_u64(&w->wseq, v); }
static PyObject *W_get_min(WriterObject *w, void *c) { return get_u64(w->min_rseq); }
static int W_set_min(WriterObject *w, PyObject *v, void *c) { return set_u64(&w->min_rseq, v); }
static PyObject *W_get_next(WriterObject *w, void *c) { return PyFloat_FromDouble(w->next_check); }
static int W_set_next(WriterObject *w, PyObject *v, void *c) {
    if (v == NULL) {
        PyErr_SetString(PyExc_AttributeError, "cannot delete");
        return -1;
    }
    double d = PyFloat_AsDouble(v);
    if (d == -1.0 && PyErr_Occurred())
        return -1;
    w->next_check = d;
    return 0;
}
static PyObject *W_get_open(WriterObject *w, void *c) { return PyBool_FromLong(w->b.base != NULL); }

static PyGetSetDef Writer_getset[] = {
    {"wseq", (getter)W_get_wseq, (setter)W_set_wseq, "messages published", NULL},
    {"min_rseq", (getter)W_get_min, (setter)W_set_min, "cached slowest live reader", NULL},
    {"next_check", (getter)W_get_next, (setter)W_set_next, "monotonic time of the next "
     "liveness check", NULL},
    {"is_open", (getter)W_get_open, NULL, "False once released", NULL},
    {NULL}};

static PyMethodDef Writer_methods[] = {
    {"put", (PyCFunction)(void (*)(void))Writer_put, METH_FASTCALL, Writer_put_doc},
    {"refresh_min", (PyCFunction)Writer_refresh, METH_NOARGS,
     "Re-read the live readers' positions; returns (and caches) the minimum."},
    {"release", base_release_meth, METH_NOARGS, "Drop the mapping (the queue closes)."},
    {NULL}};

static PyTypeObject WriterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvwire.shm._ring.Writer",
    .tp_basicsize = sizeof(WriterObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Writer(mm, n_reader, max_chunk_bytes, max_chunks, header_size, chunk_stride, "
              "dumps, asymmetric, spin_s, raw_min=4096): writer-side hot path and state.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Writer_init,
    .tp_dealloc = (destructor)Writer_dealloc,
    .tp_methods = Writer_methods,
    .tp_getset = Writer_getset,
};

/* ================================================================== Reader */
typedef struct {
    RingBase b;
    uint64_t rseq;         /* messages consumed (mirrors our rseq word, which we alone write) */
    uint64_t *rseq_word;
    uint8_t *sleep_flag;   /* our byte in the sleepers' line */
    Py_ssize_t copy_max;   /* larger single frames are left to the slow path */
    int why;
    int fast;              /* try the pickle subset codec before pickle.loads */
    PyObject *loads;       /* pickle.loads */
} ReaderObject;

static int Reader_init(ReaderObject *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"mm", "n_reader", "max_chunk_bytes", "max_chunks", "header_size",
                            "chunk_stride", "index", "loads", "asymmetric", "spin_s",
                            "copy_max", "fast_codec", NULL};
    PyObject *mm, *loads;
    unsigned int n_reader, index;
    unsigned long long cbytes, nchunks;
    Py_ssize_t hdr, stride, copy_max = 1 << 16;
    int asym, fast = 1;
    double spin_s;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OIKKnnIOpd|np:Reader", names, &mm, &n_reader,
                                     &cbytes, &nchunks, &hdr, &stride, &index, &loads, &asym,
                                     &spin_s, &copy_max, &fast))
        return -1;
    if (!PyCallable_Check(loads)) {
        PyErr_SetString(PyExc_TypeError, "loads must be callable");
        return -1;
    }
    if (index >= n_reader) {
        PyErr_SetString(PyExc_ValueError, "reader index out of range");
        return -1;
    }
    if (base_init(&self->b, mm, n_reader, cbytes, nchunks, hdr, stride, asym, spin_s) < 0)
        return -1;
    self->rseq_word = (uint64_t *)(self->b.base + OFF_READERS + (Py_ssize_t)index * LINE + R_SEQ);
    self->rseq = __atomic_load_n(self->rseq_word, __ATOMIC_RELAXED);
    self->sleep_flag = (uint8_t *)(self->b.base + OFF_SLEEPERS + index);
    self->copy_max = copy_max;
    self->fast = fast;
    self->why = 0;
    Py_INCREF(loads);
    self->loads = loads;
    return 0;
}

static void Reader_dealloc(ReaderObject *self) {
    base_release(&self->b);
    Py_XDECREF(self->loads);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Spin (pause; after 50 us also sched_yield) until the seq word reads `want`, the writer
 * shuts down, or `budget` ns pass. Returns 1 when the message is there, 0 when not, -1
 * (error set) when the queue was closed meanwhile. */
static int reader_spin(ReaderObject *r, uint64_t *seqw, uint64_t want, int64_t budget) {
    const uint32_t *state = (const uint32_t *)(r->b.base + OFF_WRITER_STATE);
    int64_t start = mono_ns(), end = start + budget, yield_after = start + YIELD_AFTER_NS;
    for (unsigned i = 1;; i++) {
        cpu_relax();
        if (__atomic_load_n(seqw, __ATOMIC_ACQUIRE) == want)
            return 1;
        if ((i & 7) == 0) {
            if (__atomic_load_n(state, __ATOMIC_RELAXED) == W_SHUTDOWN)
                return 0;
            int64_t t = mono_ns();
            if (t >= end)
                return 0;
            if (t >= yield_after && yield_gil(&r->b) < 0)
                return -1;
        }
    }
}

static PyObject *reader_slow(ReaderObject *r, int why) {
    r->why = why;
    Py_INCREF(SLOW);
    return SLOW;
}

/* The message for `want` is published in `chunk` (acquire-loaded): take it if it is one
 * pickle frame we copy out, else SLOW. */
static PyObject *reader_take(ReaderObject *r, char *chunk, uint64_t want) {
    uint64_t *seqw = (uint64_t *)(chunk + C_SEQ);
    uint64_t meta = __atomic_load_n((uint64_t *)(chunk + C_META), __ATOMIC_RELAXED);
    Py_ssize_t n = (Py_ssize_t)(meta & MASK40);
    if ((meta >> 40) != SINGLE_HI || n > r->copy_max || (uint64_t)n > r->b.cbytes)
        return reader_slow(r, WHY_NOT_SIMPLE);
    /* copy out into private memory (the decoder then never sees the ring change) */
    unsigned char local[512];
    unsigned char *buf = n <= (Py_ssize_t)sizeof(local) ? local : PyMem_Malloc((size_t)n);
    if (buf == NULL)
        return PyErr_NoMemory();
    memcpy(buf, chunk + CHUNK_HDR, (size_t)n);
    /* seqlock-style check: the copy above happens before this re-load */
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (__atomic_load_n(seqw, __ATOMIC_RELAXED) != want) {
        if (buf != local)
            PyMem_Free(buf);
        return reader_slow(r, WHY_TORN);
    }
    /* hand the chunk back: our reads of it happen before the writer sees the new rseq */
    __atomic_store_n(r->rseq_word, want, __ATOMIC_RELEASE);
    r->rseq = want;
    publish_fence(r->b.asym);
    if (__atomic_load_n((const uint8_t *)(r->b.base + OFF_WRITER_SLEEPING), __ATOMIC_RELAXED))
        bump_and_wake((uint32_t *)(r->b.base + OFF_WWAKE));
    PyObject *obj = r->fast ? kvw_p5_loads(buf, n) : NULL;
    if (obj == NULL) {
        PyObject *data = PyBytes_FromStringAndSize((const char *)buf, n);
        if (data != NULL) {
            obj = PyObject_Vectorcall(r->loads, &data, 1, NULL);
            Py_DECREF(data);
        }
    }
    if (buf != local)
        PyMem_Free(buf);
    return obj;
}

PyDoc_STRVAR(Reader_get_doc,
"get(timeout=None) -> object | SLOW\n\n"
"The next message if it is one pickle frame of at most copy_max bytes (the chunk is handed\n"
"back before unpickling; an unpickling error consumes the message). Spins up to spin_s\n"
"(capped by timeout) for it; never sleeps. SLOW otherwise; .why says why.");

static PyObject *Reader_get(ReaderObject *r, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "get(timeout=None)");
        return NULL;
    }
    if (check_open(&r->b) < 0)
        return NULL;
    uint64_t want = r->rseq + 1;
    char *chunk = chunk_at(&r->b, r->rseq);
    uint64_t *seqw = (uint64_t *)(chunk + C_SEQ);
    if (__atomic_load_n(seqw, __ATOMIC_ACQUIRE) != want) {
        int64_t budget = budget_ns(r->b.spin_ns, nargs ? args[0] : NULL);
        if (budget < 0)
            return NULL;
        int got = budget > 0 ? reader_spin(r, seqw, want, budget) : 0;
        if (got < 0)
            return NULL;
        if (!got)
            return reader_slow(r, WHY_NOT_READY);
    }
    return reader_take(r, chunk, want);
}

PyDoc_STRVAR(Reader_wait_get_doc,
"wait_get(max_s) -> object | SLOW\n\n"
"One sleep round, then as get(0): read the readers' futex word, set our sleeping flag,\n"
"fence (membarrier when asymmetric, else seq_cst), re-check, futex-wait at most max_s\n"
"with the GIL released, clear the flag. Taking the message right here, in C, keeps the\n"
"interpreter off the path between the kernel's wake-up and the caller getting it.\n"
"SLOW with why=NOT_READY: nothing yet (timeout, signal, writer shut down).");

static PyObject *Reader_wait_get(ReaderObject *r, PyObject *arg) {
    double max_s = PyFloat_AsDouble(arg);
    if (max_s == -1.0 && PyErr_Occurred())
        return NULL;
    if (check_open(&r->b) < 0)
        return NULL;
    uint64_t want = r->rseq + 1;
    char *chunk = chunk_at(&r->b, r->rseq);
    uint64_t *seqw = (uint64_t *)(chunk + C_SEQ);
    const uint32_t *state = (const uint32_t *)(r->b.base + OFF_WRITER_STATE);
    uint32_t *word = (uint32_t *)(r->b.base + OFF_RWAKE);
    if (__atomic_load_n(seqw, __ATOMIC_ACQUIRE) == want)
        return reader_take(r, chunk, want);
    /* Dekker with the writer's "publish seq; fence; load flags": read the futex word
     * before raising the flag, so a wake-up after our check changes it (no lost wake) */
    uint32_t g = __atomic_load_n(word, __ATOMIC_ACQUIRE);
    __atomic_store_n(r->sleep_flag, 1, __ATOMIC_RELAXED);
    if (r->b.asym) {
        if (syscall(SYS_membarrier, MEMBARRIER_GLOBAL_EXPEDITED, 0, 0) != 0) {
            __atomic_store_n(r->sleep_flag, 0, __ATOMIC_RELAXED);
            return PyErr_SetFromErrno(PyExc_OSError);
        }
    } else {
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
    }
    long rc = 0;
    int err = 0;
    if (__atomic_load_n(seqw, __ATOMIC_ACQUIRE) != want &&
        __atomic_load_n(state, __ATOMIC_RELAXED) != W_SHUTDOWN && max_s > 0) {
        struct timespec ts, *tsp = NULL;
        if (max_s < 1e9) {
            ts.tv_sec = (time_t)max_s;
            ts.tv_nsec = (long)((max_s - (double)ts.tv_sec) * 1e9);
            if (ts.tv_nsec > 999999999)
                ts.tv_nsec = 999999999;
            tsp = &ts;
        }
        r->b.busy++;
        Py_BEGIN_ALLOW_THREADS
        rc = syscall(SYS_futex, word, FUTEX_WAIT, g, tsp, NULL, 0);
        err = errno;
        Py_END_ALLOW_THREADS
        r->b.busy--;
    }
    __atomic_store_n(r->sleep_flag, 0, __ATOMIC_RELAXED);
    if (r->b.release_pending && !r->b.busy) { /* closed by another thread meanwhile */
        r->b.release_pending = 0;
        base_release(&r->b);
        check_open(&r->b); /* sets "ring released" */
        return NULL;
    }
    if (rc != 0 && err != EAGAIN && err != EINTR && err != ETIMEDOUT) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    if (__atomic_load_n(seqw, __ATOMIC_ACQUIRE) == want)
        return reader_take(r, chunk, want);
    return reader_slow(r, WHY_NOT_READY);
}

static PyObject *R_get_rseq(ReaderObject *r, void *c) { return get_u64(r->rseq); }
static int R_set_rseq(ReaderObject *r, PyObject *v, void *c) { return set_u64(&r->rseq, v); }
static PyObject *R_get_why(ReaderObject *r, void *c) { return PyLong_FromLong(r->why); }
static PyObject *R_get_open(ReaderObject *r, void *c) { return PyBool_FromLong(r->b.base != NULL); }

static PyGetSetDef Reader_getset[] = {
    {"rseq", (getter)R_get_rseq, (setter)R_set_rseq, "messages consumed", NULL},
    {"why", (getter)R_get_why, NULL, "reason of the last SLOW result", NULL},
    {"is_open", (getter)R_get_open, NULL, "False once released", NULL},
    {NULL}};

static PyMethodDef Reader_methods[] = {
    {"get", (PyCFunction)(void (*)(void))Reader_get, METH_FASTCALL, Reader_get_doc},
    {"wait_get", (PyCFunction)Reader_wait_get, METH_O, Reader_wait_get_doc},
    {"release", base_release_meth, METH_NOARGS, "Drop the mapping (the queue closes)."},
    {NULL}};

static PyTypeObject ReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvwire.shm._ring.Reader",
    .tp_basicsize = sizeof(ReaderObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Reader(mm, n_reader, max_chunk_bytes, max_chunks, header_size, chunk_stride, "
              "index, loads, asymmetric, spin_s, copy_max=65536): reader-side hot path and "
              "state.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Reader_init,
    .tp_dealloc = (destructor)Reader_dealloc,
    .tp_methods = Reader_methods,
    .tp_getset = Reader_getset,
};

/* ============================================================ module functions */
static uint32_t *word_arg(PyObject *o) {
    void *p = PyLong_AsVoidPtr(o);
    if (p == NULL && !PyErr_Occurred())
        PyErr_SetString(PyExc_ValueError, "null address");
    else if ((uintptr_t)p % 4) {
        PyErr_SetString(PyExc_ValueError, "futex word must be 4-byte aligned");
        p = NULL;
    }
    return p;
}

PyDoc_STRVAR(futex_wait_doc,
"futex_wait(addr, expected, timeout=None) -> int\n\n"
"Sleep (GIL released) while the shared u32 at addr equals expected, at most timeout s.\n"
"Returns 0 on timeout, else the CLOCK_MONOTONIC time in ns taken right after the\n"
"kernel returned (woken, value already changed, or interrupted by a signal).");

static PyObject *m_futex_wait(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 2 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "futex_wait(addr, expected, timeout=None)");
        return NULL;
    }
    uint32_t *addr = word_arg(args[0]);
    if (addr == NULL)
        return NULL;
    unsigned long expected = PyLong_AsUnsignedLongMask(args[1]);
    if (expected == (unsigned long)-1 && PyErr_Occurred())
        return NULL;
    struct timespec ts, *tsp = NULL;
    if (nargs == 3 && args[2] != Py_None) {
        double t = PyFloat_AsDouble(args[2]);
        if (t == -1.0 && PyErr_Occurred())
            return NULL;
        if (!(t > 0))
            t = 0;
        if (t < 1e9) { /* else: no timeout */
            ts.tv_sec = (time_t)t;
            ts.tv_nsec = (long)((t - (double)ts.tv_sec) * 1e9);
            if (ts.tv_nsec > 999999999)
                ts.tv_nsec = 999999999;
            tsp = &ts;
        }
    }
    long rc;
    int err;
    int64_t woke;
    Py_BEGIN_ALLOW_THREADS
    rc = syscall(SYS_futex, addr, FUTEX_WAIT, (uint32_t)expected, tsp, NULL, 0);
    woke = mono_ns();
    err = errno;
    Py_END_ALLOW_THREADS
    if (rc == 0 || err == EAGAIN || err == EINTR)
        return PyLong_FromLongLong(woke > 0 ? woke : 1);
    if (err == ETIMEDOUT)
        return PyLong_FromLong(0);
    errno = err;
    return PyErr_SetFromErrno(PyExc_OSError);
}

static PyObject *m_futex_wake(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "futex_wake(addr, n=INT_MAX)");
        return NULL;
    }
    uint32_t *addr = word_arg(args[0]);
    if (addr == NULL)
        return NULL;
    int n = INT_MAX;
    if (nargs == 2) {
        long v = PyLong_AsLong(args[1]);
        if (v == -1 && PyErr_Occurred())
            return NULL;
        n = v < 1 ? 1 : (v > INT_MAX ? INT_MAX : (int)v);
    }
    long rc = futex_wake_raw(addr, n);
    if (rc < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromLong(rc);
}

static PyObject *m_bump_and_wake(PyObject *m, PyObject *arg) {
    uint32_t *addr = word_arg(arg);
    if (addr == NULL)
        return NULL;
    __atomic_fetch_add(addr, 1, __ATOMIC_SEQ_CST);
    long rc = futex_wake_raw(addr, INT_MAX);
    if (rc < 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    return PyLong_FromLong(rc);
}

static PyObject *m_fence(PyObject *m, PyObject *unused) {
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

static PyObject *m_membarrier(PyObject *m, PyObject *unused) {
    if (syscall(SYS_membarrier, MEMBARRIER_GLOBAL_EXPEDITED, 0, 0) != 0)
        return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_NONE;
}

static PyObject *m_dumps_fast(PyObject *m, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "dumps_fast(obj, cap=1 << 20)");
        return NULL;
    }
    Py_ssize_t cap = 1 << 20;
    if (nargs == 2 && ((cap = PyLong_AsSsize_t(args[1])) < 0 || cap > (1 << 30))) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "cap out of range");
        return NULL;
    }
    unsigned char *buf = PyMem_Malloc(cap ? (size_t)cap : 1);
    if (buf == NULL)
        return PyErr_NoMemory();
    Py_ssize_t n = kvw_p5_dumps_into(args[0], buf, cap);
    PyObject *r = n < 0 ? Py_NewRef(Py_None) : PyBytes_FromStringAndSize((const char *)buf, n);
    PyMem_Free(buf);
    return r;
}

static PyObject *m_loads_fast(PyObject *m, PyObject *arg) {
    Py_buffer v;
    if (PyObject_GetBuffer(arg, &v, PyBUF_SIMPLE) < 0)
        return NULL;
    PyObject *o = kvw_p5_loads(v.buf, v.len);
    PyBuffer_Release(&v);
    if (o == NULL) {
        Py_INCREF(SLOW);
        return SLOW;
    }
    return o;
}

static PyObject *m_monotonic_ns(PyObject *m, PyObject *unused) {
    return PyLong_FromLongLong(mono_ns());
}

static PyMethodDef module_methods[] = {
    {"futex_wait", (PyCFunction)(void (*)(void))m_futex_wait, METH_FASTCALL, futex_wait_doc},
    {"futex_wake", (PyCFunction)(void (*)(void))m_futex_wake, METH_FASTCALL,
     "futex_wake(addr, n=INT_MAX) -> number of processes woken"},
    {"bump_and_wake", m_bump_and_wake, METH_O,
     "bump_and_wake(addr): atomically add 1 to the u32 at addr, wake all its sleepers"},
    {"fence", m_fence, METH_NOARGS, "A full (seq_cst) memory fence."},
    {"membarrier", m_membarrier, METH_NOARGS,
     "membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED): a full fence on every CPU running a "
     "registered process"},
    {"dumps_fast", (PyCFunction)(void (*)(void))m_dumps_fast, METH_FASTCALL,
     "dumps_fast(obj, cap=1 << 20) -> bytes | None: the subset codec's pickle (None: not "
     "a subset object, or over cap bytes). For tests."},
    {"loads_fast", m_loads_fast, METH_O,
     "loads_fast(data) -> object | SLOW: the subset codec's unpickler (SLOW: pickle.loads "
     "needed). For tests."},
    {"monotonic_ns", m_monotonic_ns, METH_NOARGS,
     "CLOCK_MONOTONIC in ns (the clock of futex_wait's result and time.monotonic)"},
    {NULL}};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "kvwire.shm._ring",
    "C hot path of kvwire.shm.MessageQueue (optional; see docs/shm.md).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__ring(void) {
    if (PyType_Ready(&WriterType) < 0 || PyType_Ready(&ReaderType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL)
        return NULL;
    SLOW = PyObject_CallNoArgs((PyObject *)&PyBaseObject_Type);
    kw_buffer_cb = Py_BuildValue("(s)", "buffer_callback");
    protocol5 = PyLong_FromLong(5);
    PyObject *layout = Py_BuildValue(
        "{s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:i,s:K,s:i,s:i,s:K,s:i}",
        "VERSION", LAYOUT_VERSION, "LINE", LINE, "OFF_WRITER_STATE", OFF_WRITER_STATE,
        "OFF_RWAKE", OFF_RWAKE, "OFF_WWAKE", OFF_WWAKE, "OFF_WRITER_SLEEPING",
        OFF_WRITER_SLEEPING, "OFF_SLEEPERS", OFF_SLEEPERS, "OFF_READERS", OFF_READERS,
        "R_SEQ", R_SEQ, "R_STATUS", R_STATUS, "R_DROPPED", R_DROPPED, "R_CLOSED", R_CLOSED,
        "W_SHUTDOWN", W_SHUTDOWN, "CHUNK_HDR", CHUNK_HDR, "C_SEQ", C_SEQ, "SINGLE_HI",
        (unsigned long long)SINGLE_HI, "C_META", C_META, "F_SINGLE", F_SINGLE, "MASK40",
        (unsigned long long)MASK40, "MAX_READERS", MAX_READERS);
    if (SLOW == NULL || kw_buffer_cb == NULL || protocol5 == NULL || layout == NULL ||
        PyModule_AddObject(m, "LAYOUT", layout) < 0) {
        Py_XDECREF(layout);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(SLOW);
    Py_INCREF(&WriterType);
    Py_INCREF(&ReaderType);
    if (PyModule_AddObject(m, "SLOW", SLOW) < 0 ||
        PyModule_AddObject(m, "Writer", (PyObject *)&WriterType) < 0 ||
        PyModule_AddObject(m, "Reader", (PyObject *)&ReaderType) < 0 ||
        PyModule_AddIntConstant(m, "NOT_READY", WHY_NOT_READY) < 0 ||
        PyModule_AddIntConstant(m, "NOT_SIMPLE", WHY_NOT_SIMPLE) < 0 ||
        PyModule_AddIntConstant(m, "TORN", WHY_TORN) < 0 ||
        PyModule_AddIntConstant(m, "MAX_READERS", MAX_READERS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
