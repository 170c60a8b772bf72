/* The pickle subset codec of kvwire.shm._ring (see _pickle5.c). */
#ifndef KVWIRE_SHM_PICKLE5_H
#define KVWIRE_SHM_PICKLE5_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Pickle `o` (protocol 5) into [buf, buf+cap). Returns the length, or -1 with no Python
 * error set: a type outside the subset, a shared/recursive container, too deep, or it does
 * not fit. The caller then uses pickle.dumps. Never runs Python code. */
Py_ssize_t kvw_p5_dumps_into(PyObject *o, unsigned char *buf, Py_ssize_t cap);

/* Unpickle [p, p+n) if it uses only the subset's opcodes; else NULL with no Python error
 * set, and the caller runs pickle.loads on the same bytes. Never runs Python code. */
PyObject *kvw_p5_loads(const unsigned char *p, Py_ssize_t n);

#endif
