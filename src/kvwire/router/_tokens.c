/* kvwire.router._tokens: the /route body's token_ids array, parsed straight into int64s.
 *
 * parse_token_ids(raw) -> bytes | None
 *   raw is the JSON text of the token_ids value (msgspec.Raw). When it is an array of plain
 *   non-negative integers below 2**32 (digits only, no leading zeros, JSON whitespace), the
 *   result is their native int64 bytes; anything else gives None, and the caller decodes the
 *   body the strict way (msgspec), which accepts or rejects it with the exact reason. So this
 *   path can only be faster, never more lenient: it builds no Python int per token (a 2k-token
 *   prompt was 2k int objects, about as much CPU as the whole routing decision).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static inline int is_ws(unsigned char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; }

static PyObject *
parse_token_ids(PyObject *self, PyObject *arg)
{
    (void)self;
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    const unsigned char *p = view.buf, *end = p + view.len;
    /* at most one int64 per two bytes of text ("1," is the shortest element) */
    Py_ssize_t cap = view.len / 2 + 1;
    PyObject *out = PyBytes_FromStringAndSize(NULL, cap * (Py_ssize_t)sizeof(int64_t));
    if (out == NULL) { PyBuffer_Release(&view); return NULL; }
    int64_t *dst = (int64_t *)PyBytes_AS_STRING(out);
    Py_ssize_t n = 0;
    while (p < end && is_ws(*p)) p++;
    if (p == end || *p != '[') goto reject;
    p++;
    while (p < end && is_ws(*p)) p++;
    if (p < end && *p == ']') { p++; goto tail; }
    for (;;) {
        if (p == end || *p < '0' || *p > '9') goto reject;
        if (*p == '0' && p + 1 < end && p[1] >= '0' && p[1] <= '9') goto reject;  /* 01 */
        uint64_t v = 0;
        int digits = 0;
        while (p < end && *p >= '0' && *p <= '9') {
            v = v * 10 + (uint64_t)(*p - '0');
            p++;
            if (++digits > 10) goto reject;
        }
        if (v >= ((uint64_t)1 << 32)) goto reject;
        if (n >= cap) goto reject;  /* cannot happen: the bound above */
        dst[n++] = (int64_t)v;
        while (p < end && is_ws(*p)) p++;
        if (p == end) goto reject;
        if (*p == ',') { p++; while (p < end && is_ws(*p)) p++; continue; }
        if (*p == ']') { p++; break; }
        goto reject;  /* 1.5, 1e3, anything else */
    }
tail:
    while (p < end && is_ws(*p)) p++;
    if (p != end) goto reject;
    PyBuffer_Release(&view);
    if (_PyBytes_Resize(&out, n * (Py_ssize_t)sizeof(int64_t)) < 0) return NULL;
    return out;
reject:
    PyBuffer_Release(&view);
    Py_DECREF(out);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"parse_token_ids", (PyCFunction)parse_token_ids, METH_O,
     "parse_token_ids(raw) -> int64 bytes of a JSON array of ints in [0, 2**32), else None"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvwire.router._tokens", NULL, -1, methods,
};

PyMODINIT_FUNC
PyInit__tokens(void)
{
    return PyModule_Create(&module);
}
