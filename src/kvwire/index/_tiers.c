/* kvwire.index._tiers: PrefixWalk.tier_prefixes' walk in C (the indexer API's per-medium
 * answer), with the prompt's keys hashed as the walk goes (no key past the end of the
 * longest prefix is hashed).
 *
 * tier_walk(keys, masks, slots, nt, cumulative) -> tuple of ints
 *   keys: any iterable of own keys. masks: PrefixWalk.keys (own key -> lane masks, 64
 *   slots per lane: lane 0 = held in any tier, lane 2 + t = held in tier t). slots: the
 *   stream slots asked (each < 64). For each slot in order, the leading keys it holds
 *   in any tier, then in each tier alone (nt of them), then with ``cumulative`` in tiers
 *   0..t for t = 1..nt-1: 1 + nt (+ nt - 1) ints per slot. Predictions are not counted.
 * tier_walk_tokens(tokens, bs, n, seed, fold, masks, slots, nt, cumulative)
 *   the same over the chained keys of the first n blocks of bs tokens of `tokens` (an
 *   int64 buffer): the standard scheme when `fold` is an int (`seed` then None; `fold`
 *   seeds the local hashes, the chain is always seeded by Dynamo's 1337), the kvwire
 *   scheme (XXH3 of the block's int64 bytes, seeded by the key before, `seed` first) when
 *   `fold` is None: what kvwire.index.keys.chain_tokens computes, key for key.
 *
 * Only CPython builds whose ints are 30-bit digits (3.10, 3.11) read the masks' lanes
 * straight from the int's digits; elsewhere the module has no functions and the Python
 * walk answers (same answers).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

unsigned long long XXH3_64bits_withSeed(const void *input, size_t length,
                                        unsigned long long seed);

#define W 64
#define MAX_TIERS 14                /* (2 + nt) lanes of 64 bits, nl = 2 nt lanes kept */
#define MAX_LANES (2 * MAX_TIERS)
#define MAX_SLOTS 64

#include "_lanes.h"

#if FAST_LANES

/* One walk: what a key's masks change in the lanes still alive. */
typedef struct {
    int nt, nl, cumulative;
    uint64_t mask;                  /* the slots asked */
    uint64_t alive[MAX_LANES];
    Py_ssize_t ends[MAX_LANES][MAX_SLOTS];
    Py_ssize_t i;                   /* keys looked at so far */
    int any_alive;
} Walk;

static void
walk_init(Walk *w, uint64_t mask, int nt, int cumulative)
{
    w->nt = nt;
    w->cumulative = cumulative;
    w->nl = cumulative ? 2 * nt : nt + 1;
    w->mask = mask;
    for (int l = 0; l < w->nl; l++) w->alive[l] = mask;
    w->i = 0;
    w->any_alive = mask != 0;
}

/* Feed one key's masks (NULL: nobody holds it). 0: go on; 1: every prefix has ended;
 * -1: a mask that is not a non-negative int (error set). */
static int
walk_key(Walk *w, PyObject *v)
{
    uint64_t held[MAX_LANES];
    if (v == NULL) return 1;
    if (!PyLong_CheckExact(v) || Py_SIZE(v) < 0) {
        PyErr_SetString(PyExc_TypeError, "tier_walk: lane masks must be non-negative ints");
        return -1;
    }
    held[0] = lane_bits(v, 0) & w->mask;
    if (!held[0]) return 1;  /* nobody of ours holds it: every prefix ends here */
    int nt = w->nt;
    for (int t = 0; t < nt; t++) held[1 + t] = lane_bits(v, (Py_ssize_t)(t + 2) * W) & w->mask;
    if (w->cumulative) {
        uint64_t cum = held[1];
        for (int t = 1; t < nt; t++) {
            cum |= held[1 + t];
            held[nt + t] = cum;
        }
    }
    int alive = 0;
    for (int l = 0; l < w->nl; l++) {
        uint64_t a = w->alive[l];
        if (!a) continue;
        uint64_t h = held[l] & a;
        if (h != a) {
            for (uint64_t gone = a ^ h; gone; gone &= gone - 1)
                w->ends[l][__builtin_ctzll(gone)] = w->i;
            w->alive[l] = h;
        }
        alive |= h != 0;
    }
    w->i++;
    return alive ? 0 : 1;
}

static PyObject *
walk_result(Walk *w, const int *slots, Py_ssize_t nslots)
{
    for (int l = 0; l < w->nl; l++)
        for (uint64_t a = w->alive[l]; a; a &= a - 1)
            w->ends[l][__builtin_ctzll(a)] = w->i;
    PyObject *out = PyTuple_New(nslots * w->nl);
    if (out == NULL) return NULL;
    Py_ssize_t k = 0;
    for (Py_ssize_t s = 0; s < nslots; s++) {
        for (int l = 0; l < w->nl; l++) {
            PyObject *n = PyLong_FromSsize_t(w->ends[l][slots[s]]);
            if (n == NULL) { Py_DECREF(out); return NULL; }
            PyTuple_SET_ITEM(out, k++, n);
        }
    }
    return out;
}

/* The common arguments: masks dict, slots, nt, cumulative -> a ready Walk. */
static int
walk_args(Walk *w, PyObject *masks, PyObject *slots_obj, PyObject *nt_obj, PyObject *cum_obj,
          int *slots, Py_ssize_t *nslots)
{
    if (!PyDict_CheckExact(masks)) {
        PyErr_SetString(PyExc_TypeError, "tier_walk: masks must be a dict");
        return -1;
    }
    PyObject *seq = PySequence_Fast(slots_obj, "tier_walk: slots must be a sequence");
    if (seq == NULL) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (n > MAX_SLOTS) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "tier_walk: more than 64 slots");
        return -1;
    }
    uint64_t mask = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        long s = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
        if (s == -1 && PyErr_Occurred()) { Py_DECREF(seq); return -1; }
        if (s < 0 || s >= MAX_SLOTS) {
            Py_DECREF(seq);
            PyErr_SetString(PyExc_ValueError, "tier_walk: a slot out of 0..63");
            return -1;
        }
        slots[i] = (int)s;
        mask |= (uint64_t)1 << s;
    }
    Py_DECREF(seq);
    long nt = PyLong_AsLong(nt_obj);
    if (nt == -1 && PyErr_Occurred()) return -1;
    if (nt < 1 || nt > MAX_TIERS) {
        PyErr_SetString(PyExc_ValueError, "tier_walk: nt out of 1..14");
        return -1;
    }
    int cumulative = PyObject_IsTrue(cum_obj);
    if (cumulative < 0) return -1;
    *nslots = n;
    walk_init(w, mask, (int)nt, cumulative);
    return 0;
}

/* masks[key] (borrowed, NULL when absent; -1 on error) */
static inline int
lookup(PyObject *masks, uint64_t k, PyObject **v)
{
    PyObject *key = PyLong_FromUnsignedLongLong(k);
    if (key == NULL) return -1;
    *v = PyDict_GetItemWithError(masks, key);
    Py_DECREF(key);
    if (*v == NULL && PyErr_Occurred()) return -1;
    return 0;
}

static PyObject *
tier_walk(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "tier_walk(keys, masks, slots, nt, cumulative)");
        return NULL;
    }
    Walk w;
    int slots[MAX_SLOTS];
    Py_ssize_t nslots;
    if (walk_args(&w, args[1], args[2], args[3], args[4], slots, &nslots) < 0) return NULL;
    PyObject *it = PyObject_GetIter(args[0]);
    if (it == NULL) return NULL;
    PyObject *masks = args[1], *k;
    while (w.any_alive && (k = PyIter_Next(it)) != NULL) {
        PyObject *v = PyDict_GetItemWithError(masks, k);
        Py_DECREF(k);
        if (v == NULL && PyErr_Occurred()) { Py_DECREF(it); return NULL; }
        int r = walk_key(&w, v);
        if (r < 0) { Py_DECREF(it); return NULL; }
        if (r) break;
    }
    Py_DECREF(it);
    if (PyErr_Occurred()) return NULL;
    return walk_result(&w, slots, nslots);
}

#define STACK_TOKENS 4096

static PyObject *
tier_walk_tokens(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    (void)self;
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "tier_walk_tokens(tokens, bs, n, seed, fold, masks, "
                        "slots, nt, cumulative)");
        return NULL;
    }
    Py_ssize_t bs = PyLong_AsSsize_t(args[1]);
    if (bs == -1 && PyErr_Occurred()) return NULL;
    Py_ssize_t n = PyLong_AsSsize_t(args[2]);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (bs <= 0 || n < 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive and n >= 0");
        return NULL;
    }
    int std = args[4] != Py_None;
    uint64_t fold = 0, k = 0;
    int has_prev = !std;
    if (std) {
        fold = PyLong_AsUnsignedLongLong(args[4]);
        if (fold == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
        if (args[3] != Py_None) {
            PyErr_SetString(PyExc_ValueError, "the standard scheme starts with seed None");
            return NULL;
        }
    } else {
        k = PyLong_AsUnsignedLongLong(args[3]);
        if (k == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    }
    Walk w;
    int slots[MAX_SLOTS];
    Py_ssize_t nslots;
    if (walk_args(&w, args[5], args[6], args[7], args[8], slots, &nslots) < 0) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_SIMPLE) < 0) return NULL;
    const int64_t *flat = (const int64_t *)view.buf;
    if (n > view.len / 8 / bs) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "fewer token ids than n blocks of block_size");
        return NULL;
    }
    uint32_t stackbuf[STACK_TOKENS];
    uint32_t *b32 = stackbuf;
    if (std && bs > STACK_TOKENS) {
        b32 = PyMem_Malloc((size_t)bs * sizeof(uint32_t));
        if (b32 == NULL) { PyBuffer_Release(&view); return PyErr_NoMemory(); }
    }
    PyObject *masks = args[5], *result = NULL;
    for (Py_ssize_t i = 0; i < n && w.any_alive; i++) {
        const int64_t *blk = flat + i * bs;
        if (std) {
            for (Py_ssize_t j = 0; j < bs; j++) {
                if (blk[j] < 0 || blk[j] > (int64_t)0xFFFFFFFF) {
                    PyErr_SetString(PyExc_ValueError, "token ids must fit in an unsigned "
                                    "32-bit integer (standard scheme)");
                    goto done;
                }
                b32[j] = (uint32_t)blk[j];
            }
            uint64_t local = XXH3_64bits_withSeed(b32, (size_t)bs * 4, fold);
            if (has_prev) {
                uint64_t pair[2] = {k, local};
                k = XXH3_64bits_withSeed(pair, 16, 1337ULL);  /* the chain's fixed seed */
            } else {
                k = local;
                has_prev = 1;
            }
        } else {
            k = XXH3_64bits_withSeed(blk, (size_t)bs * 8, k);
        }
        PyObject *v;
        if (lookup(masks, k, &v) < 0) goto done;
        int r = walk_key(&w, v);
        if (r < 0) goto done;
        if (r) break;
    }
    result = walk_result(&w, slots, nslots);
done:
    if (b32 != stackbuf) PyMem_Free(b32);
    PyBuffer_Release(&view);
    return result;
}
#endif

static PyMethodDef methods[] = {
#if FAST_LANES
    {"tier_walk", (PyCFunction)(void (*)(void))tier_walk, METH_FASTCALL,
     "tier_walk(keys, masks, slots, nt, cumulative) -> per slot: any, each tier alone, "
     "(tiers 0..t)"},
    {"tier_walk_tokens", (PyCFunction)(void (*)(void))tier_walk_tokens, METH_FASTCALL,
     "tier_walk_tokens(tokens, bs, n, seed, fold, masks, slots, nt, cumulative): "
     "tier_walk over the chained keys of the tokens' blocks, hashed as walked"},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvwire.index._tiers", NULL, -1, methods,
};

PyMODINIT_FUNC
PyInit__tiers(void)
{
    return PyModule_Create(&module);
}
