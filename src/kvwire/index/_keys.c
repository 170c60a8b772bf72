/* kvwire.index._keys: the chained block keys of kvwire.index.keys.chain, in C.
 *
 * chain_tokens(tokens, block_size, n, seed, start=0) -> list[int]
 *   keys of blocks start..n-1 of the token-id sequence `tokens`: key[i] =
 *   XXH3_64bits_withSeed(int64 native bytes of block i, seed = key[i-1]), key[start-1] = seed
 *   (so a walk can hash a first few blocks, and the rest only if it gets that far).
 * chain_tokens(tokens, block_size, n, prev, start=0, fold=None) with an int `fold`: the
 *   standard scheme (RFC #1527 sequence hashes, docs/prefix-index.md): tokens as little-endian u32,
 *   local = XXH3(block, fold), key = local when `prev` is None (no block before), else
 *   XXH3(le64(prev) || le64(local), 1337), then prev = key: the chain's seed is always
 *   Dynamo's 1337, a LoRA name or cache namespace (in `fold`) seeds the local hash only.
 *   Exactly what the pure-Python path computes (array('q') bytes + xxhash's xxh3_64), but
 *   reading the ints straight from the list: no intermediate bytes object, no slices.
 *
 * XXH3 comes from the system's libxxhash (the same algorithm, stable since xxHash 0.8.0, as
 * the `xxhash` Python package bundles); its one prototype is declared here because Debian
 * ships the header only in libxxhash-dev. The module is optional: without libxxhash or a
 * compiler the build skips it and kvwire uses the pure-Python path.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>
#ifdef __linux__
#include <sys/mman.h>
#endif

unsigned long long XXH3_64bits_withSeed(const void *input, size_t length,
                                        unsigned long long seed);

#define STACK_TOKENS 1024
#define LOOKAHEAD 8

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the standard scheme hashes the host's uint32/uint64 bytes as little-endian"
#endif

/* One token id as int64: 0 or -1 with the error set. Token ids below 2**30 are one digit in
 * CPython < 3.12: read it directly (the conversion was a third of the walk's time). */
static inline int
tok_value(PyObject *o, int64_t *out)
{
#if PY_VERSION_HEX < 0x030C0000 && PYLONG_BITS_IN_DIGIT == 30
    if (PyLong_CheckExact(o)) {
        Py_ssize_t sz = Py_SIZE(o);
        if (sz == 1) { *out = (int64_t)((PyLongObject *)o)->ob_digit[0]; return 0; }
        if (sz == 0) { *out = 0; return 0; }
        if (sz == -1) { *out = -(int64_t)((PyLongObject *)o)->ob_digit[0]; return 0; }
    }
#endif
    if (!PyLong_Check(o)) {
        PyErr_SetString(PyExc_ValueError, "token ids must be a sequence of integers");
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow) {
        PyErr_SetString(PyExc_ValueError, "token ids must fit in a signed 64-bit integer");
        return -1;
    }
    if (v == -1 && PyErr_Occurred()) return -1;
    *out = (int64_t)v;
    return 0;
}

/* The standard scheme's chain seed (Dynamo's XXH3 seed), whatever the local hashes' seed. */
#define STD_CHAIN_SEED 1337ULL

/* The standard scheme's next key from `bs` u32 tokens (see the header). */
static inline uint64_t
std_next(int has_prev, uint64_t prev, const uint32_t *blk, Py_ssize_t bs, uint64_t fold)
{
    uint64_t local = XXH3_64bits_withSeed(blk, (size_t)bs * 4, fold);
    if (!has_prev) return local;
    uint64_t pair[2] = {prev, local};
    return XXH3_64bits_withSeed(pair, 16, STD_CHAIN_SEED);
}

static inline int
tok_u32(int64_t v, uint32_t *out)
{
    if (v < 0 || v > (int64_t)0xFFFFFFFF) {
        PyErr_SetString(PyExc_ValueError,
                        "token ids must fit in an unsigned 32-bit integer (standard scheme)");
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

/* Block i's tokens as u32 into out32, from list/tuple items or an int64 buffer. */
static inline int
fill_u32(PyObject **items, const int64_t *flat, Py_ssize_t i, Py_ssize_t bs, uint32_t *out32)
{
    int64_t v;
    for (Py_ssize_t j = 0; j < bs; j++) {
        if (items != NULL) {
            if (tok_value(items[i * bs + j], &v) < 0) return -1;
        } else {
            v = flat[i * bs + j];
        }
        if (tok_u32(v, &out32[j]) < 0) return -1;
    }
    return 0;
}

/* chain_tokens in the standard scheme (fold given). */
static PyObject *
chain_std(PyObject *src, Py_ssize_t bs, Py_ssize_t n, PyObject *prev, Py_ssize_t start,
          uint64_t fold)
{
    int has_prev = prev != Py_None;
    uint64_t k = 0;
    if (has_prev) {
        k = PyLong_AsUnsignedLongLong(prev);
        if (k == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    }
    Py_buffer view;
    int have_view = 0;
    const int64_t *flat = NULL;
    PyObject **items = NULL;
    PyObject *seq = NULL;
    Py_ssize_t len;
    if (!PyList_CheckExact(src) && !PyTuple_CheckExact(src) && PyObject_CheckBuffer(src)
        && PyObject_GetBuffer(src, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) == 0) {
        const char *f = view.format ? view.format : "B";
        if (*f == '<' || *f == '=' || *f == '@') f++;
        if (view.itemsize == 8 && view.ndim == 1 && (strcmp(f, "q") == 0 || strcmp(f, "l") == 0)) {
            have_view = 1;
            flat = (const int64_t *)view.buf;
            len = view.len / 8;
        } else {
            PyBuffer_Release(&view);
        }
    } else {
        PyErr_Clear();
    }
    if (!have_view) {
        seq = PySequence_Fast(src, "token ids must be a sequence of integers");
        if (seq == NULL) {
            PyErr_SetString(PyExc_ValueError, "token ids must be a sequence of integers");
            return NULL;
        }
        items = PySequence_Fast_ITEMS(seq);
        len = PySequence_Fast_GET_SIZE(seq);
    }
    PyObject *out = NULL;
    uint32_t stack32[STACK_TOKENS];
    uint32_t *b32 = stack32;
    if (n > len / bs) {
        PyErr_SetString(PyExc_ValueError, "fewer token ids than n blocks of block_size");
        goto end;
    }
    if (bs > STACK_TOKENS && (b32 = PyMem_Malloc((size_t)bs * 4)) == NULL) {
        b32 = stack32;
        PyErr_NoMemory();
        goto end;
    }
    out = PyList_New(n > start ? n - start : 0);
    if (out == NULL) goto end;
    for (Py_ssize_t i = start; i < n; i++) {
        if (fill_u32(items, flat, i, bs, b32) < 0) { Py_CLEAR(out); goto end; }
        k = std_next(has_prev, k, b32, bs, fold);
        has_prev = 1;
        PyObject *key = PyLong_FromUnsignedLongLong(k);
        if (key == NULL) { Py_CLEAR(out); goto end; }
        PyList_SET_ITEM(out, i - start, key);
    }
end:
    if (b32 != stack32) PyMem_Free(b32);
    if (have_view) PyBuffer_Release(&view);
    Py_XDECREF(seq);
    return out;
}

static PyObject *
chain_tokens(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs < 4 || nargs > 6) {
        PyErr_SetString(PyExc_TypeError,
                        "chain_tokens(tokens, block_size, n, seed, start=0, fold=None)");
        return NULL;
    }
    Py_ssize_t start = 0;
    if (nargs >= 5) {
        start = PyLong_AsSsize_t(args[4]);
        if (start == -1 && PyErr_Occurred()) return NULL;
    }
    Py_ssize_t bs = PyLong_AsSsize_t(args[1]);
    if (bs == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t n = PyLong_AsSsize_t(args[2]);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (bs <= 0 || n < 0 || start < 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive, n and start >= 0");
        return NULL;
    }
    if (nargs == 6 && args[5] != Py_None) {
        unsigned long long fold = PyLong_AsUnsignedLongLong(args[5]);
        if (fold == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
        return chain_std(args[0], bs, n, args[3], start, fold);
    }
    unsigned long long seed = PyLong_AsUnsignedLongLong(args[3]);
    if (seed == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    PyObject *src = args[0];
    if (!PyList_CheckExact(src) && !PyTuple_CheckExact(src) && PyObject_CheckBuffer(src)) {
        /* an int64 buffer (array('q'), numpy int64): hash its memory directly */
        Py_buffer view;
        if (PyObject_GetBuffer(src, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) == 0) {
            const char *f = view.format ? view.format : "B";
            if (*f == '<' || *f == '=' || *f == '@') f++;
            if (view.itemsize == 8 && view.ndim == 1 && (strcmp(f, "q") == 0 || strcmp(f, "l") == 0)) {
                Py_ssize_t blen = view.len / 8;
                if (n > blen / bs) {
                    PyBuffer_Release(&view);
                    PyErr_SetString(PyExc_ValueError, "fewer token ids than n blocks of block_size");
                    return NULL;
                }
                PyObject *res = PyList_New(n > start ? n - start : 0);
                if (res != NULL) {
                    const int64_t *toks = (const int64_t *)view.buf;
                    unsigned long long k = seed;
                    for (Py_ssize_t i = start; i < n; i++) {
                        k = XXH3_64bits_withSeed(toks + i * bs, (size_t)bs * 8, k);
                        PyObject *key = PyLong_FromUnsignedLongLong(k);
                        if (key == NULL) { Py_CLEAR(res); break; }
                        PyList_SET_ITEM(res, i - start, key);
                    }
                }
                PyBuffer_Release(&view);
                return res;
            }
            PyBuffer_Release(&view);
        } else {
            PyErr_Clear();
        }
    }
    PyObject *seq = PySequence_Fast(src, "token ids must be a sequence of integers");
    if (seq == NULL) {
        PyErr_SetString(PyExc_ValueError, "token ids must be a sequence of integers");
        return NULL;
    }
    Py_ssize_t len = PySequence_Fast_GET_SIZE(seq);
    if (n > len / bs) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "fewer token ids than n blocks of block_size");
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int64_t stackbuf[STACK_TOKENS];
    int64_t *buf = stackbuf;
    if (bs > STACK_TOKENS) {
        buf = PyMem_Malloc((size_t)bs * sizeof(int64_t));
        if (buf == NULL) {
            Py_DECREF(seq);
            return PyErr_NoMemory();
        }
    }
    PyObject *out = PyList_New(n > start ? n - start : 0);
    if (out == NULL) goto fail;
    unsigned long long k = seed;
    for (Py_ssize_t i = start; i < n; i++) {
        PyObject **blk = items + i * bs;
        for (Py_ssize_t j = 0; j < bs; j++) {
            if (tok_value(blk[j], &buf[j]) < 0) goto fail;
        }
        k = XXH3_64bits_withSeed(buf, (size_t)bs * sizeof(int64_t), k);
        PyObject *key = PyLong_FromUnsignedLongLong(k);
        if (key == NULL) goto fail;
        PyList_SET_ITEM(out, i - start, key);
    }
    if (buf != stackbuf) PyMem_Free(buf);
    Py_DECREF(seq);
    return out;
fail:
    if (buf != stackbuf) PyMem_Free(buf);
    Py_DECREF(seq);
    Py_XDECREF(out);
    return NULL;
}

#include "_lanes.h"

/* Lanes: a uint64 key -> (lane 0, lane 1) mirror of PrefixIndex._keys while it has 64 slots
 * per lane, in one open-addressing table (linear probing, backward-shift deletion, 24 bytes
 * an entry). The scan reads it instead of the dict: one cache line per block instead of the
 * dict's index, entry, key and value objects (the walk over 1M keys is memory-bound). It is
 * only a hint of the fast path: a key absent here (or any == 0) stops the scan, and the
 * Python walk then reads the dict; so it may miss keys, never invent them. */
typedef struct { uint64_t key, any, nb; } LaneEntry;
typedef struct {
    PyObject_HEAD
    LaneEntry *tab;
    size_t mask;   /* slots - 1 (slots a power of two) */
    size_t used;
    int huge;      /* tab from tab_alloc's aligned path (free with free, untrack) */
} LanesObject;

#define HUGE_BYTES ((size_t)2 << 20)

/* A zeroed table. From 2 MiB on: 2 MiB-aligned and advised onto huge pages, since its
 * probes are random (with 4 KiB pages each one is a TLB miss too); reported to tracemalloc
 * like PyMem memory, so the index's measured bytes per block stay true. */
static LaneEntry *tab_alloc(size_t slots, int *huge)
{
    size_t bytes = slots * sizeof(LaneEntry);
    *huge = 0;
#ifdef __linux__
    if (bytes >= HUGE_BYTES) {
        void *p = NULL;
        if (posix_memalign(&p, HUGE_BYTES, bytes) == 0) {
            (void)madvise(p, bytes, MADV_HUGEPAGE);
            memset(p, 0, bytes);
            (void)PyTraceMalloc_Track(0, (uintptr_t)p, bytes);
            *huge = 1;
            return p;
        }
    }
#endif
    return PyMem_Calloc(slots, sizeof(LaneEntry));
}

static void tab_free(LaneEntry *tab, int huge)
{
    if (tab == NULL) return;
    if (huge) {
        (void)PyTraceMalloc_Untrack(0, (uintptr_t)tab);
        free(tab);
    } else {
        PyMem_Free(tab);
    }
}

static PyTypeObject LanesType;

static inline size_t lanes_home(const LanesObject *L, uint64_t k)
{
    return (size_t)((k ^ (k >> 29)) * 0x9E3779B97F4A7C15ULL >> 7) & L->mask;
}

static inline const LaneEntry *lanes_find(const LanesObject *L, uint64_t k)
{
    size_t i = lanes_home(L, k);
    for (;;) {
        const LaneEntry *e = &L->tab[i];
        if (e->any == 0) return NULL;
        if (e->key == k) return e;
        i = (i + 1) & L->mask;
    }
}

static int lanes_resize(LanesObject *L, size_t slots)
{
    int huge;
    LaneEntry *nt = tab_alloc(slots, &huge);
    if (nt == NULL) { PyErr_NoMemory(); return -1; }
    LaneEntry *old = L->tab;
    int old_huge = L->huge;
    size_t oslots = old ? L->mask + 1 : 0;
    L->tab = nt;
    L->mask = slots - 1;
    for (size_t j = 0; j < oslots; j++) {
        if (old[j].any == 0) continue;
        size_t i = lanes_home(L, old[j].key);
        while (nt[i].any != 0) i = (i + 1) & L->mask;
        nt[i] = old[j];
    }
    tab_free(old, old_huge);
    L->huge = huge;
    return 0;
}

static void lanes_del(LanesObject *L, uint64_t k)
{
    size_t i = lanes_home(L, k);
    for (;;) {
        if (L->tab[i].any == 0) return;
        if (L->tab[i].key == k) break;
        i = (i + 1) & L->mask;
    }
    L->used--;
    size_t j = i;
    for (;;) {  /* backward shift: move later entries of the cluster into the hole */
        L->tab[i].any = 0;
        for (;;) {
            j = (j + 1) & L->mask;
            if (L->tab[j].any == 0) return;
            size_t h = lanes_home(L, L->tab[j].key);
            /* entry j may fill the hole i if its home is not cyclically in (i, j] */
            if (i <= j ? (h <= i || h > j) : (h <= i && h > j)) break;
        }
        L->tab[i] = L->tab[j];
        i = j;
    }
}

static int lanes_put(LanesObject *L, uint64_t k, uint64_t any, uint64_t nb)
{
    if (any == 0) { lanes_del(L, k); return 0; }
    if ((L->used + 1) * 4 > (L->mask + 1) * 3) {
        if (lanes_resize(L, (L->mask + 1) * 2) < 0) return -1;
    }
    size_t i = lanes_home(L, k);
    for (;;) {
        LaneEntry *e = &L->tab[i];
        if (e->any == 0) { e->key = k; e->any = any; e->nb = nb; L->used++; return 0; }
        if (e->key == k) { e->any = any; e->nb = nb; return 0; }
        i = (i + 1) & L->mask;
    }
}

/* lanes 0 and 1 of a mask int v (64 slots per lane); -1 when v is not a non-negative int */
static int lanes_of(PyObject *v, uint64_t *any, uint64_t *nb)
{
#if FAST_LANES
    if (PyLong_CheckExact(v) && Py_SIZE(v) >= 0) {
        *any = lane_bits(v, 0);
        *nb = lane_bits(v, 64);
        return 0;
    }
#endif
    PyObject *full = PyLong_FromUnsignedLongLong(~0ULL);
    if (full == NULL) return -1;
    PyObject *lo = PyNumber_And(v, full);
    PyObject *sh = PyLong_FromLong(64);
    PyObject *hi = sh ? PyNumber_Rshift(v, sh) : NULL;
    PyObject *hi2 = hi ? PyNumber_And(hi, full) : NULL;
    int rc = -1;
    if (lo && hi2) {
        *any = PyLong_AsUnsignedLongLong(lo);
        *nb = PyLong_AsUnsignedLongLong(hi2);
        rc = PyErr_Occurred() ? -1 : 0;
    }
    Py_XDECREF(full); Py_XDECREF(lo); Py_XDECREF(sh); Py_XDECREF(hi); Py_XDECREF(hi2);
    return rc;
}

static int lanes_set_obj(LanesObject *L, PyObject *key, PyObject *v)
{
    uint64_t k = PyLong_AsUnsignedLongLong(key);
    if (k == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    uint64_t any, nb;
    if (lanes_of(v, &any, &nb) < 0) return -1;
    return lanes_put(L, k, any, nb);
}

static PyObject *Lanes_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    (void)args; (void)kw;
    LanesObject *L = (LanesObject *)type->tp_alloc(type, 0);
    if (L == NULL) return NULL;
    if (lanes_resize(L, 64) < 0) { Py_DECREF(L); return NULL; }
    return (PyObject *)L;
}

static void Lanes_dealloc(LanesObject *L)
{
    tab_free(L->tab, L->huge);
    Py_TYPE(L)->tp_free((PyObject *)L);
}

static PyObject *Lanes_set(LanesObject *L, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "set(key, mask)"); return NULL; }
    if (lanes_set_obj(L, args[0], args[1]) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Lanes_discard(LanesObject *L, PyObject *key)
{
    uint64_t k = PyLong_AsUnsignedLongLong(key);
    if (k == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    lanes_del(L, k);
    Py_RETURN_NONE;
}

static PyObject *Lanes_get(LanesObject *L, PyObject *key)
{
    uint64_t k = PyLong_AsUnsignedLongLong(key);
    if (k == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    const LaneEntry *e = lanes_find(L, k);
    if (e == NULL) Py_RETURN_NONE;
    return Py_BuildValue("(KK)", (unsigned long long)e->any, (unsigned long long)e->nb);
}

static PyObject *Lanes_clear(LanesObject *L, PyObject *unused)
{
    (void)unused;
    LaneEntry *nt = PyMem_Calloc(64, sizeof(LaneEntry));
    if (nt == NULL) return PyErr_NoMemory();
    tab_free(L->tab, L->huge);
    L->huge = 0;
    L->tab = nt;
    L->mask = 63;
    L->used = 0;
    Py_RETURN_NONE;
}

static Py_ssize_t Lanes_len(LanesObject *L) { return (Py_ssize_t)L->used; }

static PyMethodDef Lanes_methods[] = {
    {"set", (PyCFunction)(void (*)(void))Lanes_set, METH_FASTCALL, "set(key, mask): mirror lanes 0/1"},
    {"discard", (PyCFunction)Lanes_discard, METH_O, "discard(key)"},
    {"get", (PyCFunction)Lanes_get, METH_O, "get(key) -> (lane0, lane1) or None"},
    {"clear", (PyCFunction)Lanes_clear, METH_NOARGS, "clear()"},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods Lanes_as_seq = { .sq_length = (lenfunc)Lanes_len };

static PyTypeObject LanesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvwire.index._keys.Lanes",
    .tp_basicsize = sizeof(LanesObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "uint64 key -> lanes 0/1 of PrefixIndex masks (64 slots per lane)",
    .tp_new = Lanes_new,
    .tp_dealloc = (destructor)Lanes_dealloc,
    .tp_methods = Lanes_methods,
    .tp_as_sequence = &Lanes_as_seq,
};

/* scan_tokens(tokens, block_size, n, start, seed, masks, alive, not_best) -> (i, key)
 *   The match walk's fast path: hash blocks start.. of `tokens` (chained from `seed`) and
 *   look each key up in `masks`, while the block is held by every stream in `alive` and by
 *   none of them outside the best tier (`v & not_best == 0`). Returns the first block that
 *   is not so (and its key), or (n, key of block n-1) / (n, seed) at the end. Predictions
 *   need no look here: a prediction counts only for a stream that does not hold the block,
 *   and the scan already stops where a stream of `alive` does not. Only list/tuple tokens
 *   or an int64 buffer. A ninth argument is the Lanes mirror (or None); a tenth, `fold`,
 *   selects the standard scheme (`seed` is then the previous block's key, or None before
 *   the first block; see chain_std). */
static PyObject *
scan_tokens(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs < 8 || nargs > 10 || !PyDict_CheckExact(args[5])
        || (nargs >= 9 && args[8] != Py_None && !PyObject_TypeCheck(args[8], &LanesType))) {
        PyErr_SetString(PyExc_TypeError,
                        "scan_tokens(tokens, bs, n, start, seed, masks, alive, not_best)");
        return NULL;
    }
    Py_ssize_t bs = PyLong_AsSsize_t(args[1]);
    if (bs == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t n = PyLong_AsSsize_t(args[2]);
    if (n == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t start = PyLong_AsSsize_t(args[3]);
    if (start == -1 && PyErr_Occurred()) return NULL;
    int std = nargs == 10 && args[9] != Py_None;
    uint64_t fold = 0;
    if (std) {
        fold = PyLong_AsUnsignedLongLong(args[9]);
        if (fold == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    }
    int has_prev = !(std && args[4] == Py_None);
    unsigned long long k = 0;
    if (has_prev) {
        k = PyLong_AsUnsignedLongLong(args[4]);
        if (k == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    }
    PyObject *masks = args[5], *alive = args[6], *not_best = args[7];
    LanesObject *lanes = (nargs >= 9 && args[8] != Py_None) ? (LanesObject *)args[8] : NULL;
    if (bs <= 0 || n < 0 || start < 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive, n and start >= 0");
        return NULL;
    }
    PyObject *src = args[0];
    Py_buffer view;
    int have_view = 0;
    const int64_t *flat = NULL;
    PyObject **items = NULL;
    Py_ssize_t len;
    if (PyList_CheckExact(src) || PyTuple_CheckExact(src)) {
        items = PySequence_Fast_ITEMS(src);
        len = PySequence_Fast_GET_SIZE(src);
    } else {
        if (PyObject_GetBuffer(src, &view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return NULL;
        have_view = 1;
        const char *f = view.format ? view.format : "B";
        if (*f == '<' || *f == '=' || *f == '@') f++;
        if (!(view.itemsize == 8 && view.ndim == 1 && (strcmp(f, "q") == 0 || strcmp(f, "l") == 0))) {
            PyBuffer_Release(&view);
            PyErr_SetString(PyExc_TypeError, "scan_tokens: tokens must be a list, tuple or int64 buffer");
            return NULL;
        }
        flat = (const int64_t *)view.buf;
        len = view.len / 8;
    }
    if (n > len / bs) {
        if (have_view) PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "fewer token ids than n blocks of block_size");
        return NULL;
    }
    int64_t stackbuf[STACK_TOKENS];
    int64_t *buf = stackbuf;
    if (items != NULL && bs > STACK_TOKENS) {
        buf = PyMem_Malloc((size_t)bs * sizeof(int64_t));
        if (buf == NULL) {
            if (have_view) PyBuffer_Release(&view);
            return PyErr_NoMemory();
        }
    }
    /* the standard scheme's u32 block (it reuses the int64 buffer's memory: 2x the room) */
    uint32_t *b32 = (uint32_t *)buf;
    if (std && items == NULL && bs > 2 * STACK_TOKENS) {
        buf = PyMem_Malloc((size_t)bs * sizeof(int64_t));
        if (buf == NULL) {
            if (have_view) PyBuffer_Release(&view);
            return PyErr_NoMemory();
        }
        b32 = (uint32_t *)buf;
    }
    /* fast lanes: alive fits in 64 bits and not_best == alive << W (how _scan calls it) */
    uint64_t alive64 = 0;
    Py_ssize_t lane_w = -1;
#if FAST_LANES
    if (PyLong_CheckExact(alive) && PyLong_CheckExact(not_best) && Py_SIZE(alive) > 0) {
        alive64 = PyLong_AsUnsignedLongLong(alive);
        if (alive64 == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
        } else {
            int64_t w = (int64_t)_PyLong_NumBits(not_best) - (int64_t)_PyLong_NumBits(alive);
            if (w >= 64) {
                PyObject *sh = PyLong_FromLongLong(w);
                PyObject *chk = sh ? PyNumber_Lshift(alive, sh) : NULL;
                Py_XDECREF(sh);
                if (chk == NULL) { if (have_view) PyBuffer_Release(&view); if (buf != stackbuf) PyMem_Free(buf); return NULL; }
                int same = PyObject_RichCompareBool(chk, not_best, Py_EQ);
                Py_DECREF(chk);
                if (same < 0) { if (have_view) PyBuffer_Release(&view); if (buf != stackbuf) PyMem_Free(buf); return NULL; }
                if (same) lane_w = (Py_ssize_t)w;
            }
        }
    }
#endif
    PyObject *key = NULL, *result = NULL;
    Py_ssize_t i = start;
    if (lanes != NULL && lane_w == 64) {
        /* the mirror: no int objects, one probe per block; blocks are hashed 8 ahead and
         * their slots prefetched, so the probes' cache misses overlap */
        uint64_t ks[LOOKAHEAD];
        while (i < n) {
            Py_ssize_t g = n - i < LOOKAHEAD ? n - i : LOOKAHEAD;
            uint64_t kk = k;
            for (Py_ssize_t j = 0; j < g; j++) {
                const void *data;
                if (std) {
                    if (fill_u32(items, flat, i + j, bs, b32) < 0) {
                        if (j == 0) goto done;
                        PyErr_Clear();
                        g = j;
                        break;
                    }
                    kk = std_next(has_prev, kk, b32, bs, fold);
                    has_prev = 1;
                    ks[j] = kk;
#ifdef __GNUC__
                    __builtin_prefetch(&lanes->tab[lanes_home(lanes, kk)]);
#endif
                    continue;
                }
                if (items != NULL) {
                    PyObject **blk = items + (i + j) * bs;
                    Py_ssize_t q = 0;
                    while (q < bs && tok_value(blk[q], &buf[q]) == 0) q++;
                    if (q < bs) {
                        if (j == 0) goto done;
                        PyErr_Clear();  /* past where the walk may stop: hash it then */
                        g = j;
                        break;
                    }
                    data = buf;
                } else {
                    data = flat + (i + j) * bs;
                }
                kk = XXH3_64bits_withSeed(data, (size_t)bs * sizeof(int64_t), kk);
                ks[j] = kk;
#ifdef __GNUC__
                __builtin_prefetch(&lanes->tab[lanes_home(lanes, kk)]);
#endif
            }
            Py_ssize_t j = 0;
            for (; j < g; j++) {
                const LaneEntry *e = lanes_find(lanes, ks[j]);
                if (e == NULL || (e->any & alive64) != alive64 || (e->nb & alive64)) break;
            }
            if (j < g) {
                i += j;
                k = ks[j];
                goto stopped;
            }
            i += g;
            k = ks[g - 1];
        }
        goto stopped;
    }
    for (; i < n; i++) {
        const void *data;
        if (std) {
            if (fill_u32(items, flat, i, bs, b32) < 0) goto done;
            k = std_next(has_prev, k, b32, bs, fold);
            has_prev = 1;
        } else {
            if (items != NULL) {
                PyObject **blk = items + i * bs;
                for (Py_ssize_t j = 0; j < bs; j++) {
                    if (tok_value(blk[j], &buf[j]) < 0) goto done;
                }
                data = buf;
            } else {
                data = flat + i * bs;
            }
            k = XXH3_64bits_withSeed(data, (size_t)bs * sizeof(int64_t), k);
        }
        Py_XDECREF(key);
        key = PyLong_FromUnsignedLongLong(k);
        if (key == NULL) goto done;
        PyObject *v = PyDict_GetItemWithError(masks, key); /* borrowed */
        if (v == NULL) {
            if (PyErr_Occurred()) goto done;
            break;
        }
#if FAST_LANES
        if (lane_w > 0 && PyLong_CheckExact(v) && Py_SIZE(v) >= 0) {
            if ((lane_bits(v, 0) & alive64) != alive64) break;
            if (lane_bits(v, lane_w) & alive64) break;
            continue;
        }
#endif
        PyObject *t = PyNumber_And(v, alive);
        if (t == NULL) goto done;
        int eq = PyObject_RichCompareBool(t, alive, Py_EQ);
        Py_DECREF(t);
        if (eq < 0) goto done;
        if (!eq) break;
        t = PyNumber_And(v, not_best);
        if (t == NULL) goto done;
        int nz = PyObject_IsTrue(t);
        Py_DECREF(t);
        if (nz < 0) goto done;
        if (nz) break;
    }
stopped:
    if (key == NULL && !has_prev) {  /* standard scheme, nothing hashed */
        result = Py_BuildValue("(nO)", i, Py_None);
        goto done;
    }
    if (key == NULL) {  /* nothing hashed (start >= n), or the mirror's walk */
        key = PyLong_FromUnsignedLongLong(k);
        if (key == NULL) goto done;
    }
    result = Py_BuildValue("(nO)", i, key);
done:
    Py_XDECREF(key);
    if (buf != stackbuf) PyMem_Free(buf);
    if (have_view) PyBuffer_Release(&view);
    return result;
}

/* add_bits(masks, keys, setb, keep, tb) -> list of the keys whose masks already had tb
 *   for each key: masks[key] = setb when absent, else (masks[key] | setb) & keep unless
 *   masks[key] & tb (then the key is returned: a second engine hash for it). The ingest
 *   loop of PrefixIndex._add for new best-tier blocks, without the interpreter per block. */
#if FAST_LANES
#define MAX_MASK_DIGITS 64
/* 1 if non-negative ints a and b share a set bit, 0 if not, -1 if either is not such an int */
static inline int
common_bits(PyObject *a, PyObject *b)
{
    if (!PyLong_CheckExact(a) || !PyLong_CheckExact(b) || Py_SIZE(a) < 0 || Py_SIZE(b) < 0)
        return -1;
    Py_ssize_t n = Py_SIZE(a) < Py_SIZE(b) ? Py_SIZE(a) : Py_SIZE(b);
    const digit *x = ((PyLongObject *)a)->ob_digit, *y = ((PyLongObject *)b)->ob_digit;
    for (Py_ssize_t i = 0; i < n; i++)
        if (x[i] & y[i]) return 1;
    return 0;
}

/* (v | s) & ~c for non-negative ints, as one new int built from their digits (the ingest's
 * mask update without the three temporary ints of the generic number protocol); NULL
 * without an error set when an argument does not fit this path. */
static PyObject *
or_andnot(PyObject *v, PyObject *s, PyObject *c)
{
    if (!PyLong_CheckExact(v) || !PyLong_CheckExact(s) || !PyLong_CheckExact(c)
        || Py_SIZE(v) < 0 || Py_SIZE(s) < 0 || Py_SIZE(c) < 0)
        return NULL;
    Py_ssize_t nv = Py_SIZE(v), ns = Py_SIZE(s), nc = Py_SIZE(c);
    Py_ssize_t n = nv > ns ? nv : ns;
    if (n > MAX_MASK_DIGITS) return NULL;
    const digit *dv = ((PyLongObject *)v)->ob_digit, *ds = ((PyLongObject *)s)->ob_digit;
    const digit *dc = ((PyLongObject *)c)->ob_digit;
    digit out[MAX_MASK_DIGITS];
    for (Py_ssize_t i = 0; i < n; i++) {
        digit d = (i < nv ? dv[i] : 0) | (i < ns ? ds[i] : 0);
        if (i < nc) d &= ~dc[i];
        out[i] = d & PyLong_MASK;
    }
    while (n > 0 && out[n - 1] == 0) n--;
    if (n == 0) return PyLong_FromLong(0);
    PyLongObject *r = _PyLong_New(n);
    if (r == NULL) return NULL;
    memcpy(r->ob_digit, out, (size_t)n * sizeof(digit));
    return (PyObject *)r;
}
#endif

/* Predictions (PrefixIndex.predict_keys / _expire): a stream's own key -> expiry map and the
 * index's own key -> slot mask map, each a tuple of 2**b dicts holding key k in the one at
 * k >> (64 - b) (state.PRED_SHARDS). One call per prompt instead of a Python step per block. */
static int
pred_shards(PyObject *t, Py_ssize_t *n, int *shift)
{
    if (!PyTuple_CheckExact(t)) {
        PyErr_SetString(PyExc_TypeError, "prediction maps are tuples of dicts");
        return -1;
    }
    Py_ssize_t m = PyTuple_GET_SIZE(t);
    if (m < 1 || m > (1 << 16) || (m & (m - 1))) {
        PyErr_SetString(PyExc_ValueError, "prediction maps hold 2**b dicts");
        return -1;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        if (!PyDict_CheckExact(PyTuple_GET_ITEM(t, i))) {
            PyErr_SetString(PyExc_TypeError, "prediction maps are tuples of dicts");
            return -1;
        }
    }
    int b = 0;
    while (((Py_ssize_t)1 << b) < m) b++;
    *n = m;
    *shift = 64 - b;
    return 0;
}

static inline PyObject *
pred_shard(PyObject *t, Py_ssize_t n, int shift, uint64_t k)
{
    return PyTuple_GET_ITEM(t, n == 1 ? 0 : (Py_ssize_t)(k >> shift));
}

/* the keys argument: a C-contiguous buffer of uint64 (array('Q')) */
static int
pred_keys(PyObject *o, Py_buffer *view)
{
    if (!PyObject_CheckBuffer(o)) {
        PyErr_SetString(PyExc_TypeError, "keys must be array('Q')");
        return -1;
    }
    if (PyObject_GetBuffer(o, view, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0) return -1;
    const char *f = view->format ? view->format : "B";
    if (view->itemsize != 8 || !(f[0] == 'Q' || ((f[0] == '=' || f[0] == '<' || f[0] == '@')
                                                 && f[1] == 'Q'))) {
        PyBuffer_Release(view);
        PyErr_SetString(PyExc_TypeError, "keys must be array('Q')");
        return -1;
    }
    return 0;
}

/* the arguments of pred_add and pred_expire: (keys, expiry, masks, exp or now, bit) */
typedef struct {
    Py_ssize_t ne, nm;  /* shards of expiry and of masks */
    int se, sm;         /* their shifts */
    Py_buffer view;     /* the keys (released by the caller) */
} PredArgs;

static int
pred_args(PyObject *const *args, Py_ssize_t nargs, const char *sig, PredArgs *a)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, sig);
        return -1;
    }
    if (pred_shards(args[1], &a->ne, &a->se) < 0 || pred_shards(args[2], &a->nm, &a->sm) < 0)
        return -1;
    return pred_keys(args[0], &a->view);
}

/* pred_add(keys, expiry, masks, exp, bit): for each key k, expiry[k] = exp and
 * masks[k] = masks.get(k, 0) | bit (each map sharded as above). */
static PyObject *
pred_add(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    PredArgs a;
    if (pred_args(args, nargs, "pred_add(keys, expiry, masks, exp, bit)", &a) < 0) return NULL;
    Py_ssize_t ne = a.ne, nm = a.nm;
    int se = a.se, sm = a.sm;
    PyObject *exp = args[3], *bit = args[4];
    const uint64_t *ks = (const uint64_t *)a.view.buf;
    Py_ssize_t count = a.view.len / 8;
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t k = ks[i];
        PyObject *key = PyLong_FromUnsignedLongLong(k);
        if (key == NULL) goto fail;
        if (PyDict_SetItem(pred_shard(args[1], ne, se, k), key, exp) < 0) {
            Py_DECREF(key);
            goto fail;
        }
        PyObject *d = pred_shard(args[2], nm, sm, k);
        PyObject *v = PyDict_GetItemWithError(d, key); /* borrowed */
        PyObject *nv;
        if (v == NULL) {
            if (PyErr_Occurred()) { Py_DECREF(key); goto fail; }
            nv = Py_NewRef(bit);
        } else {
            nv = PyNumber_Or(v, bit);
            if (nv == NULL) { Py_DECREF(key); goto fail; }
        }
        int rc = PyDict_SetItem(d, key, nv);
        Py_DECREF(nv);
        Py_DECREF(key);
        if (rc < 0) goto fail;
    }
    PyBuffer_Release(&a.view);
    Py_RETURN_NONE;
fail:
    PyBuffer_Release(&a.view);
    return NULL;
}

/* pred_expire(keys, expiry, masks, now, bit): for each key k whose expiry[k] is <= now,
 * delete it and clear `bit` from masks[k] (the entry goes when no bit is left). A key
 * predicted again since has a later expiry and stays. */
static PyObject *
pred_expire(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    PredArgs a;
    if (pred_args(args, nargs, "pred_expire(keys, expiry, masks, now, bit)", &a) < 0)
        return NULL;
    Py_ssize_t ne = a.ne, nm = a.nm;
    int se = a.se, sm = a.sm;
    double now = PyFloat_AsDouble(args[3]);
    PyObject *inv = now == -1.0 && PyErr_Occurred() ? NULL : PyNumber_Invert(args[4]);
    if (inv == NULL) { PyBuffer_Release(&a.view); return NULL; }
    const uint64_t *ks = (const uint64_t *)a.view.buf;
    Py_ssize_t count = a.view.len / 8;
    for (Py_ssize_t i = 0; i < count; i++) {
        uint64_t k = ks[i];
        PyObject *key = PyLong_FromUnsignedLongLong(k);
        if (key == NULL) goto fail;
        PyObject *de = pred_shard(args[1], ne, se, k);
        PyObject *e = PyDict_GetItemWithError(de, key); /* borrowed */
        if (e == NULL) {
            Py_DECREF(key);
            if (PyErr_Occurred()) goto fail;
            continue;
        }
        double ev = PyFloat_AsDouble(e);
        if (ev == -1.0 && PyErr_Occurred()) { Py_DECREF(key); goto fail; }
        if (ev > now) { Py_DECREF(key); continue; }
        if (PyDict_DelItem(de, key) < 0) { Py_DECREF(key); goto fail; }
        PyObject *dm = pred_shard(args[2], nm, sm, k);
        PyObject *v = PyDict_GetItemWithError(dm, key); /* borrowed */
        if (v == NULL) {
            Py_DECREF(key);
            if (PyErr_Occurred()) goto fail;
            continue;
        }
        PyObject *nv = PyNumber_And(v, inv);
        if (nv == NULL) { Py_DECREF(key); goto fail; }
        int keep = PyObject_IsTrue(nv);
        int rc = keep < 0 ? -1 : keep ? PyDict_SetItem(dm, key, nv) : PyDict_DelItem(dm, key);
        Py_DECREF(nv);
        Py_DECREF(key);
        if (rc < 0) goto fail;
    }
    PyBuffer_Release(&a.view);
    Py_DECREF(inv);
    Py_RETURN_NONE;
fail:
    PyBuffer_Release(&a.view);
    Py_DECREF(inv);
    return NULL;
}

static PyObject *
add_bits(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if ((nargs != 5 && nargs != 6) || !PyDict_CheckExact(args[0]) || !PyList_CheckExact(args[1])
        || (nargs == 6 && args[5] != Py_None && !PyObject_TypeCheck(args[5], &LanesType))) {
        PyErr_SetString(PyExc_TypeError, "add_bits(dict, list, setb, keep, tb, lanes=None)");
        return NULL;
    }
    PyObject *masks = args[0], *keys = args[1], *setb = args[2], *keep = args[3];
    PyObject *tb = args[4];
    LanesObject *lanes = (nargs == 6 && args[5] != Py_None) ? (LanesObject *)args[5] : NULL;
    uint64_t set_any = 0, set_nb = 0;  /* setb's lanes, for every new key */
    if (lanes != NULL && lanes_of(setb, &set_any, &set_nb) < 0) return NULL;
    PyObject *clear = NULL;  /* ~keep: the bits the update clears (keep is negative) */
#if FAST_LANES
    if (PyLong_CheckExact(keep) && Py_SIZE(keep) < 0) {
        clear = PyNumber_Invert(keep);
        if (clear == NULL) return NULL;
    }
#endif
    PyObject *dups = PyList_New(0);
    if (dups == NULL) { Py_XDECREF(clear); return NULL; }
    Py_ssize_t n = PyList_GET_SIZE(keys);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *k = PyList_GET_ITEM(keys, i);
#ifdef __GNUC__
        if (lanes != NULL && i + 4 < n) {  /* the mirror slot a few keys on: overlap misses */
            PyObject *ahead = PyList_GET_ITEM(keys, i + 4);
            if (PyLong_CheckExact(ahead) && Py_SIZE(ahead) > 0) {
                uint64_t ka = PyLong_AsUnsignedLongLong(ahead);
                if (ka == (unsigned long long)-1 && PyErr_Occurred()) PyErr_Clear();
                else __builtin_prefetch(&lanes->tab[lanes_home(lanes, ka)], 1);
            }
        }
#endif
        PyObject *v = PyDict_GetItemWithError(masks, k); /* borrowed */
        if (v == NULL) {
            if (PyErr_Occurred() || PyDict_SetItem(masks, k, setb) < 0) goto fail;
            if (lanes != NULL) {
                uint64_t kk = PyLong_AsUnsignedLongLong(k);
                if (kk == (unsigned long long)-1 && PyErr_Occurred()) goto fail;
                if (lanes_put(lanes, kk, set_any, set_nb) < 0) goto fail;
            }
            continue;
        }
        int dup = -1;
        PyObject *nv = NULL;
#if FAST_LANES
        dup = common_bits(v, tb);
        if (dup == 0 && clear != NULL) {
            nv = or_andnot(v, setb, clear);
            if (nv == NULL && PyErr_Occurred()) goto fail;
        }
#endif
        if (dup < 0) {
            PyObject *has = PyNumber_And(v, tb);
            if (has == NULL) goto fail;
            dup = PyObject_IsTrue(has);
            Py_DECREF(has);
            if (dup < 0) goto fail;
        }
        if (dup) {
            if (PyList_Append(dups, k) < 0) goto fail;
            continue;
        }
        if (nv == NULL) {
            PyObject *o = PyNumber_Or(v, setb);
            if (o == NULL) goto fail;
            nv = PyNumber_And(o, keep);
            Py_DECREF(o);
            if (nv == NULL) goto fail;
        }
        int rc = PyDict_SetItem(masks, k, nv);
        if (rc == 0 && lanes != NULL) rc = lanes_set_obj(lanes, k, nv);
        Py_DECREF(nv);
        if (rc < 0) goto fail;
    }
    Py_XDECREF(clear);
    return dups;
fail:
    Py_XDECREF(clear);
    Py_DECREF(dups);
    return NULL;
}

/* KeyMap: one stream's engine block hash -> own key, per tier (PrefixIndex's h2k and its
 * remembered removals), in one open-addressing table of 17 bytes a slot instead of a dict
 * entry and two int objects (about 100 bytes): with 64 engines holding copies of the same
 * prefixes, these maps are almost all of the index's memory. Linear probing, backward-shift
 * deletion; the table grows by half when 7/8 full (so it is 58-88% full, any size: slots
 * are not a power of two, the home slot is the mix's high bits scaled to the slot count).
 * A slot is {hash, key} (two uint64) and a control byte: 0 when empty, else 0x80 |
 * sign << 6 | 6 low bits of the hash's mix, so a probe past other entries mostly reads
 * control bytes only, and -1 and 2**64 - 1 stay two hashes. Engine hashes that are not
 * 64-bit ints (32-byte digests, bigger ints) live in a dict beside the table. Own keys (the
 * values) are always uint64. Tables from 64 KiB on are mmap'ed and unmapped when they grow,
 * so the heap keeps no holes of outgrown tables (which stayed resident). The pure-Python path
 * uses a dict (same behaviour). */
typedef struct {
    PyObject_HEAD
    uint8_t *ctrl;     /* slots control bytes, then (8-aligned) hk */
    uint64_t *hk;      /* 2 * slots: hash, key */
    size_t slots;      /* 0 with no table */
    size_t used;
    int mapped;        /* the table is an mmap of km_bytes(slots) */
    PyObject *other;   /* dict for the other hashes, NULL until one comes */
} KeyMapObject;

static PyTypeObject KeyMapType;

#define KM_MIN 8
#define KM_MMAP_BYTES ((size_t)64 << 10)

static inline uint64_t km_mix(uint64_t h, int neg)
{
    h ^= neg ? 0x6B76776972652D6EULL : 0;
    h ^= h >> 33; h *= 0xFF51AFD7ED558CCDULL;
    h ^= h >> 33; h *= 0xC4CEB9FE1A85EC53ULL;
    h ^= h >> 33;
    return h;
}

static inline uint8_t km_tag(uint64_t m, int neg) { return (uint8_t)(0x80 | (neg << 6) | (m & 0x3F)); }

static inline size_t km_home(uint64_t m, size_t slots)
{
    return (size_t)(((unsigned __int128)m * slots) >> 64);
}

static inline size_t km_ctrl_bytes(size_t slots) { return (slots + 7) & ~(size_t)7; }
static inline size_t km_bytes(size_t slots) { return km_ctrl_bytes(slots) + slots * 16; }

/* An engine hash as a uint64 (+ sign): 0; not a 64-bit int: 1; error: -1. */
static int km_hash(PyObject *h, uint64_t *out, int *neg)
{
    if (!PyLong_Check(h)) return 1;
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(h, &overflow);
    if (!overflow) {
        if (v == -1 && PyErr_Occurred()) return -1;
        *out = (uint64_t)v;
        *neg = v < 0;
        return 0;
    }
    if (overflow < 0) return 1;
    unsigned long long u = PyLong_AsUnsignedLongLong(h);
    if (u == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return -1;
        PyErr_Clear();
        return 1;
    }
    *out = u;
    *neg = 0;
    return 0;
}

static int km_value(PyObject *v, uint64_t *out)
{
    unsigned long long u = PyLong_AsUnsignedLongLong(v);
    if (u == (unsigned long long)-1 && PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_OverflowError) || PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_TypeError, "KeyMap values are own keys: ints in [0, 2**64)");
        }
        return -1;
    }
    *out = u;
    return 0;
}

/* the slot of (h, neg), or -1 */
static inline Py_ssize_t km_find(const KeyMapObject *M, uint64_t h, int neg)
{
    if (M->slots == 0) return -1;
    uint64_t m = km_mix(h, neg);
    uint8_t want = km_tag(m, neg);
    size_t i = km_home(m, M->slots);
    for (;;) {
        uint8_t c = M->ctrl[i];
        if (c == 0) return -1;
        if (c == want && M->hk[2 * i] == h) return (Py_ssize_t)i;
        if (++i == M->slots) i = 0;
    }
}

static void km_free_table(uint8_t *ctrl, size_t slots, int mapped)
{
    if (ctrl == NULL) return;
#ifdef __linux__
    if (mapped) {
        (void)PyTraceMalloc_Untrack(0, (uintptr_t)ctrl);
        munmap(ctrl, km_bytes(slots));
        return;
    }
#endif
    (void)slots; (void)mapped;
    PyMem_Free(ctrl);
}

static int km_resize(KeyMapObject *M, size_t slots)
{
    size_t bytes = km_bytes(slots);
    uint8_t *ctrl = NULL;
    int mapped = 0;
#ifdef __linux__
    if (bytes >= KM_MMAP_BYTES) {
        void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p != MAP_FAILED) {  /* zeroed by the kernel */
            ctrl = p;
            mapped = 1;
            (void)PyTraceMalloc_Track(0, (uintptr_t)p, bytes);
        }
    }
#endif
    if (ctrl == NULL) ctrl = PyMem_Calloc(bytes, 1);
    if (ctrl == NULL) { PyErr_NoMemory(); return -1; }
    uint64_t *hk = (uint64_t *)(ctrl + km_ctrl_bytes(slots));
    for (size_t j = 0; j < M->slots; j++) {
        uint8_t c = M->ctrl[j];
        if (c == 0) continue;
        uint64_t h = M->hk[2 * j];
        size_t i = km_home(km_mix(h, (c >> 6) & 1), slots);
        while (ctrl[i] != 0) if (++i == slots) i = 0;
        ctrl[i] = c;
        hk[2 * i] = h;
        hk[2 * i + 1] = M->hk[2 * j + 1];
    }
    km_free_table(M->ctrl, M->slots, M->mapped);
    M->ctrl = ctrl;
    M->hk = hk;
    M->slots = slots;
    M->mapped = mapped;
    return 0;
}

/* insert (h, neg) -> k. replace: overwrite a key already there. 1 inserted, 0 there, -1 error */
static int km_put(KeyMapObject *M, uint64_t h, int neg, uint64_t k, int replace)
{
    if ((M->used + 1) * 8 > M->slots * 7) {
        Py_ssize_t at = km_find(M, h, neg);
        if (at >= 0) {
            if (replace) M->hk[2 * at + 1] = k;
            return 0;
        }
        if (km_resize(M, M->slots < KM_MIN ? KM_MIN : M->slots + M->slots / 2) < 0) return -1;
    }
    uint64_t m = km_mix(h, neg);
    uint8_t want = km_tag(m, neg);
    size_t i = km_home(m, M->slots);
    for (;;) {
        uint8_t c = M->ctrl[i];
        if (c == 0) {
            M->ctrl[i] = want;
            M->hk[2 * i] = h;
            M->hk[2 * i + 1] = k;
            M->used++;
            return 1;
        }
        if (c == want && M->hk[2 * i] == h) {
            if (replace) M->hk[2 * i + 1] = k;
            return 0;
        }
        if (++i == M->slots) i = 0;
    }
}

static void km_del_at(KeyMapObject *M, size_t i)
{
    M->used--;
    size_t j = i;
    for (;;) {  /* backward shift: move later entries of the cluster into the hole */
        M->ctrl[i] = 0;
        for (;;) {
            if (++j == M->slots) j = 0;
            uint8_t c = M->ctrl[j];
            if (c == 0) return;
            size_t home = km_home(km_mix(M->hk[2 * j], (c >> 6) & 1), M->slots);
            /* entry j may fill the hole i if its home is not cyclically in (i, j] */
            if (i <= j ? (home <= i || home > j) : (home <= i && home > j)) break;
        }
        M->ctrl[i] = M->ctrl[j];
        M->hk[2 * i] = M->hk[2 * j];
        M->hk[2 * i + 1] = M->hk[2 * j + 1];
        i = j;
    }
}

static PyObject *KeyMap_new(PyTypeObject *type, PyObject *args, PyObject *kw)
{
    if (PyTuple_GET_SIZE(args) || (kw && PyDict_GET_SIZE(kw))) {
        PyErr_SetString(PyExc_TypeError, "KeyMap() takes no arguments");
        return NULL;
    }
    return type->tp_alloc(type, 0);  /* zeroed: no table until the first insert */
}

static int KeyMap_traverse(KeyMapObject *M, visitproc visit, void *arg)
{
    (void)arg;
    Py_VISIT(M->other);
    return 0;
}

static int KeyMap_clear_refs(KeyMapObject *M)
{
    Py_CLEAR(M->other);
    return 0;
}

static void KeyMap_dealloc(KeyMapObject *M)
{
    PyObject_GC_UnTrack(M);
    Py_CLEAR(M->other);
    km_free_table(M->ctrl, M->slots, M->mapped);
    Py_TYPE(M)->tp_free((PyObject *)M);
}

/* the value of h as a new reference; NULL with no error when absent */
static PyObject *km_get(KeyMapObject *M, PyObject *h)
{
    uint64_t x; int neg;
    int r = km_hash(h, &x, &neg);
    if (r < 0) return NULL;
    if (r == 0) {
        Py_ssize_t at = km_find(M, x, neg);
        return at < 0 ? NULL : PyLong_FromUnsignedLongLong(M->hk[2 * at + 1]);
    }
    if (M->other == NULL) return NULL;
    PyObject *v = PyDict_GetItemWithError(M->other, h);
    Py_XINCREF(v);
    return v;
}

/* set h -> v (replace: overwrite). 1 inserted, 0 already there, -1 error */
static int km_set(KeyMapObject *M, PyObject *h, PyObject *v, int replace)
{
    uint64_t x, k; int neg;
    if (km_value(v, &k) < 0) return -1;
    int r = km_hash(h, &x, &neg);
    if (r < 0) return -1;
    if (r == 0) return km_put(M, x, neg, k, replace);
    if (M->other == NULL && (M->other = PyDict_New()) == NULL) return -1;
    Py_ssize_t before = PyDict_GET_SIZE(M->other);
    if (replace) {
        if (PyDict_SetItem(M->other, h, v) < 0) return -1;
    } else if (PyDict_SetDefault(M->other, h, v) == NULL) {
        return -1;
    }
    return PyDict_GET_SIZE(M->other) != before;
}

/* remove h: the old value (new reference), or NULL (no error set when absent) */
static PyObject *km_pop(KeyMapObject *M, PyObject *h)
{
    uint64_t x; int neg;
    int r = km_hash(h, &x, &neg);
    if (r < 0) return NULL;
    if (r == 0) {
        Py_ssize_t at = km_find(M, x, neg);
        if (at < 0) return NULL;
        PyObject *v = PyLong_FromUnsignedLongLong(M->hk[2 * at + 1]);
        if (v != NULL) km_del_at(M, (size_t)at);
        return v;
    }
    if (M->other == NULL) return NULL;
    PyObject *v = PyDict_GetItemWithError(M->other, h);
    if (v == NULL) return NULL;
    Py_INCREF(v);
    if (PyDict_DelItem(M->other, h) < 0) { Py_DECREF(v); return NULL; }
    return v;
}

static Py_ssize_t KeyMap_len(KeyMapObject *M)
{
    return (Py_ssize_t)M->used + (M->other ? PyDict_GET_SIZE(M->other) : 0);
}

static PyObject *KeyMap_subscript(KeyMapObject *M, PyObject *h)
{
    PyObject *v = km_get(M, h);
    if (v == NULL && !PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, h);
    return v;
}

static int KeyMap_ass_subscript(KeyMapObject *M, PyObject *h, PyObject *v)
{
    if (v != NULL) return km_set(M, h, v, 1) < 0 ? -1 : 0;
    PyObject *old = km_pop(M, h);
    if (old == NULL) {
        if (!PyErr_Occurred()) PyErr_SetObject(PyExc_KeyError, h);
        return -1;
    }
    Py_DECREF(old);
    return 0;
}

static int KeyMap_contains(KeyMapObject *M, PyObject *h)
{
    PyObject *v = km_get(M, h);
    if (v == NULL) return PyErr_Occurred() ? -1 : 0;
    Py_DECREF(v);
    return 1;
}

static PyObject *KeyMap_get(KeyMapObject *M, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 1 && nargs != 2) { PyErr_SetString(PyExc_TypeError, "get(hash, default=None)"); return NULL; }
    PyObject *v = km_get(M, args[0]);
    if (v != NULL || PyErr_Occurred()) return v;
    v = nargs == 2 ? args[1] : Py_None;
    Py_INCREF(v);
    return v;
}

static PyObject *KeyMap_pop(KeyMapObject *M, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 1 && nargs != 2) { PyErr_SetString(PyExc_TypeError, "pop(hash[, default])"); return NULL; }
    PyObject *v = km_pop(M, args[0]);
    if (v != NULL || PyErr_Occurred()) return v;
    if (nargs == 1) { PyErr_SetObject(PyExc_KeyError, args[0]); return NULL; }
    Py_INCREF(args[1]);
    return args[1];
}

static PyObject *KeyMap_setdefault(KeyMapObject *M, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) { PyErr_SetString(PyExc_TypeError, "setdefault(hash, key)"); return NULL; }
    PyObject *v = km_get(M, args[0]);
    if (v != NULL || PyErr_Occurred()) return v;
    if (km_set(M, args[0], args[1], 0) < 0) return NULL;
    Py_INCREF(args[1]);
    return args[1];
}

/* items (which: 0 keys, 1 values, 2 (hash, key) pairs) as a new list, table first */
static PyObject *km_list(KeyMapObject *M, int which)
{
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    for (size_t i = 0; i < M->slots; i++) {
        uint8_t c = M->ctrl[i];
        if (c == 0) continue;
        PyObject *h = NULL, *k = NULL, *item;
        if (which != 1) {
            h = (c >> 6) & 1 ? PyLong_FromLongLong((long long)M->hk[2 * i])
                             : PyLong_FromUnsignedLongLong(M->hk[2 * i]);
            if (h == NULL) goto fail;
        }
        if (which != 0) {
            k = PyLong_FromUnsignedLongLong(M->hk[2 * i + 1]);
            if (k == NULL) { Py_XDECREF(h); goto fail; }
        }
        if (which == 2) {
            item = PyTuple_Pack(2, h, k);
            Py_DECREF(h); Py_DECREF(k);
            if (item == NULL) goto fail;
        } else {
            item = which ? k : h;
        }
        int rc = PyList_Append(out, item);
        Py_DECREF(item);
        if (rc < 0) goto fail;
    }
    if (M->other != NULL) {
        PyObject *rest = which == 0 ? PyDict_Keys(M->other)
                       : which == 1 ? PyDict_Values(M->other) : PyDict_Items(M->other);
        if (rest == NULL) goto fail;
        Py_ssize_t n = PyList_GET_SIZE(out);
        int rc = PyList_SetSlice(out, n, n, rest);
        Py_DECREF(rest);
        if (rc < 0) goto fail;
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

static PyObject *KeyMap_keys(KeyMapObject *M, PyObject *u) { (void)u; return km_list(M, 0); }
static PyObject *KeyMap_values(KeyMapObject *M, PyObject *u) { (void)u; return km_list(M, 1); }
static PyObject *KeyMap_items(KeyMapObject *M, PyObject *u) { (void)u; return km_list(M, 2); }

static PyObject *KeyMap_iter(KeyMapObject *M)
{
    PyObject *keys = km_list(M, 0);
    if (keys == NULL) return NULL;
    PyObject *it = PyObject_GetIter(keys);
    Py_DECREF(keys);
    return it;
}

static PyObject *KeyMap_clear(KeyMapObject *M, PyObject *u)
{
    (void)u;
    km_free_table(M->ctrl, M->slots, M->mapped);
    M->hk = NULL;
    M->ctrl = NULL;
    M->slots = 0;
    M->used = 0;
    M->mapped = 0;
    Py_CLEAR(M->other);
    Py_RETURN_NONE;
}

static PyObject *KeyMap_sizeof(KeyMapObject *M, PyObject *u)
{
    (void)u;
    return PyLong_FromSize_t(sizeof(KeyMapObject) + (M->slots ? km_bytes(M->slots) : 0));
}

static PyMethodDef KeyMap_methods[] = {
    {"get", (PyCFunction)(void (*)(void))KeyMap_get, METH_FASTCALL, "get(hash, default=None)"},
    {"pop", (PyCFunction)(void (*)(void))KeyMap_pop, METH_FASTCALL, "pop(hash[, default])"},
    {"setdefault", (PyCFunction)(void (*)(void))KeyMap_setdefault, METH_FASTCALL,
     "setdefault(hash, key) -> the key held for hash (key when it was new)"},
    {"keys", (PyCFunction)KeyMap_keys, METH_NOARGS, "keys() -> list of the engine hashes"},
    {"values", (PyCFunction)KeyMap_values, METH_NOARGS, "values() -> list of the own keys"},
    {"items", (PyCFunction)KeyMap_items, METH_NOARGS, "items() -> list of (hash, key)"},
    {"clear", (PyCFunction)KeyMap_clear, METH_NOARGS, "clear()"},
    {"__sizeof__", (PyCFunction)KeyMap_sizeof, METH_NOARGS, "bytes held (table included)"},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods KeyMap_as_mapping = {
    .mp_length = (lenfunc)KeyMap_len,
    .mp_subscript = (binaryfunc)KeyMap_subscript,
    .mp_ass_subscript = (objobjargproc)KeyMap_ass_subscript,
};

static PySequenceMethods KeyMap_as_seq = { .sq_contains = (objobjproc)KeyMap_contains };

static PyTypeObject KeyMapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvwire.index._keys.KeyMap",
    .tp_basicsize = sizeof(KeyMapObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "engine block hash -> own key (uint64), 17 bytes a slot; a dict's subset",
    .tp_new = KeyMap_new,
    .tp_dealloc = (destructor)KeyMap_dealloc,
    .tp_traverse = (traverseproc)KeyMap_traverse,
    .tp_clear = (inquiry)KeyMap_clear_refs,
    .tp_methods = KeyMap_methods,
    .tp_as_mapping = &KeyMap_as_mapping,
    .tp_as_sequence = &KeyMap_as_seq,
    .tp_iter = (getiterfunc)KeyMap_iter,
};

/* insert_new(d, hashes, keys) -> count
 *   d[hashes[i]] = keys[i] in order while hashes[i] is not in d yet (one probe each, by
 *   setdefault); stops at the first hash already there (or repeated) and returns how many
 *   it inserted, so the caller can undo them and take its careful path. d: a dict or a
 *   KeyMap. */
static PyObject *
insert_new(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 3 || !(PyDict_CheckExact(args[0]) || Py_IS_TYPE(args[0], &KeyMapType))
        || !PyList_CheckExact(args[1]) || !PyList_CheckExact(args[2])
        || PyList_GET_SIZE(args[1]) != PyList_GET_SIZE(args[2])) {
        PyErr_SetString(PyExc_TypeError,
                        "insert_new(dict or KeyMap, list, list of the same length)");
        return NULL;
    }
    PyObject *d = args[0];
    Py_ssize_t n = PyList_GET_SIZE(args[1]), i = 0;
    if (Py_IS_TYPE(d, &KeyMapType)) {
        for (; i < n; i++) {
            int r = km_set((KeyMapObject *)d, PyList_GET_ITEM(args[1], i),
                           PyList_GET_ITEM(args[2], i), 0);
            if (r < 0) return NULL;
            if (r == 0) break;  /* there already: left as it was */
        }
        return PyLong_FromSsize_t(i);
    }
    for (; i < n; i++) {
        Py_ssize_t before = PyDict_GET_SIZE(d);
        if (PyDict_SetDefault(d, PyList_GET_ITEM(args[1], i), PyList_GET_ITEM(args[2], i)) == NULL)
            return NULL;
        if (PyDict_GET_SIZE(d) == before) break;  /* there already: left as it was */
    }
    return PyLong_FromSsize_t(i);
}

/* bits64(mask) -> list of the set bits' indices, lowest first (mask: an int in [0, 2**64)).
 * match iterates the slots of up to 64 matched streams a few times per call. */
static PyObject *
bits64(PyObject *self, PyObject *arg)
{
    (void)self;
    unsigned long long m = PyLong_AsUnsignedLongLong(arg);
    if (m == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    PyObject *out = PyList_New(__builtin_popcountll(m));
    if (out == NULL) return NULL;
    Py_ssize_t j = 0;
    while (m) {
        PyObject *v = PyLong_FromLong(__builtin_ctzll(m));
        if (v == NULL) { Py_DECREF(out); return NULL; }
        PyList_SET_ITEM(out, j++, v);
        m &= m - 1;
    }
    return out;
}

static PyMethodDef methods[] = {
    {"insert_new", (PyCFunction)(void (*)(void))insert_new, METH_FASTCALL,
     "insert_new(d, hashes, keys) -> how many were new and inserted, in order"},
    {"bits64", (PyCFunction)bits64, METH_O, "bits64(mask) -> indices of set bits, lowest first"},
    {"scan_tokens", (PyCFunction)(void (*)(void))scan_tokens, METH_FASTCALL,
     "scan_tokens(tokens, bs, n, start, seed, masks, alive, not_best, lanes=None, "
     "fold=None) -> (i, key)"},
    {"pred_add", (PyCFunction)(void (*)(void))pred_add, METH_FASTCALL,
     "pred_add(keys, expiry, masks, exp, bit): predict keys (array('Q')) for a stream"},
    {"pred_expire", (PyCFunction)(void (*)(void))pred_expire, METH_FASTCALL,
     "pred_expire(keys, expiry, masks, now, bit): drop the stream's expired predictions"},
    {"add_bits", (PyCFunction)(void (*)(void))add_bits, METH_FASTCALL,
     "add_bits(masks, keys, setb, keep, tb) -> keys already holding tb"},
    {"chain_tokens", (PyCFunction)(void (*)(void))chain_tokens, METH_FASTCALL,
     "chain_tokens(tokens, block_size, n, seed, start=0, fold=None) -> chained block keys"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvwire.index._keys", "Chained xxh3 block keys (C).", -1, methods,
};

PyMODINIT_FUNC
PyInit__keys(void)
{
    if (PyType_Ready(&LanesType) < 0 || PyType_Ready(&KeyMapType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&KeyMapType);
    if (PyModule_AddObject(m, "KeyMap", (PyObject *)&KeyMapType) < 0) {
        Py_DECREF(&KeyMapType);
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&LanesType);
    if (PyModule_AddObject(m, "Lanes", (PyObject *)&LanesType) < 0) {
        Py_DECREF(&LanesType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
