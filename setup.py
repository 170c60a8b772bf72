"""Optional C accelerators. Each is built when a C compiler and Python's headers are there;
when the build fails, installation goes on and kvwire uses its pure-Python paths
(same behaviour, slower). ``kvwire.native_status()`` tells which are active."""

import os

from setuptools import Extension, setup

_MODULES = {
    "kvwire.wire._zmqframes": "src/kvwire/wire/_zmqframes.c",
    "kvwire.shm._ring": "src/kvwire/shm/_ring.c",
}

ext_modules = [
    Extension(name, [src], optional=True, extra_compile_args=["-O2", "-std=c11"])
    for name, src in _MODULES.items()
    if os.path.exists(src) and not os.environ.get("KVWIRE_NO_NATIVE")
]

setup(ext_modules=ext_modules)
