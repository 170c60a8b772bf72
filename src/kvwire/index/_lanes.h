/* Shared by _keys.c (the scan) and _tiers.c (the per-medium walk): a mask's 64-bit lanes
 * read straight from a Python int's digits. Only where ints are 30-bit digits in the
 * pre-3.12 layout and the compiler has 128-bit ints (FAST_LANES 1); elsewhere the modules
 * leave these paths out and Python's walk answers (same answers, slower). */
#ifndef KVWIRE_INDEX_LANES_H
#define KVWIRE_INDEX_LANES_H

#if PY_VERSION_HEX < 0x030C0000 && PYLONG_BITS_IN_DIGIT == 30 && defined(__SIZEOF_INT128__)
/* Bits off..off+63 of a non-negative int, read from its digits: the scan tests two 64-bit
 * lanes of a mask per block without allocating the two ints PyNumber_And would. */
#define FAST_LANES 1
static inline uint64_t
lane_bits(PyObject *v, Py_ssize_t off)
{
    Py_ssize_t nd = Py_SIZE(v);
    const digit *dg = ((PyLongObject *)v)->ob_digit;
    Py_ssize_t d = off / PyLong_SHIFT;
    int r = (int)(off % PyLong_SHIFT);
    unsigned __int128 acc = 0;
    for (Py_ssize_t i = d, sh = 0; i < nd && sh < 128; i++, sh += PyLong_SHIFT)
        acc |= (unsigned __int128)dg[i] << sh;
    return (uint64_t)(acc >> r);
}
#else
#define FAST_LANES 0
#endif

#endif
