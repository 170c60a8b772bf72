"""Optional C accelerators. Each is built when a C compiler and Python's headers are there;
when the build fails, installation goes on and kvwire uses its pure-Python paths
(same behaviour, slower). ``kvwire.native_status()`` tells which are active."""

import os

from setuptools import Extension, setup

_MODULES = {
    "kvwire.wire._zmqframes": "src/kvwire/wire/_zmqframes.c",
    "kvwire.wire._ids": "src/kvwire/wire/_ids.c",
    "kvwire.shm._ring": ["src/kvwire/shm/_ring.c", "src/kvwire/shm/_pickle5.c"],
    "kvwire.index._keys": "src/kvwire/index/_keys.c",
    "kvwire.index._tiers": "src/kvwire/index/_tiers.c",
    "kvwire.routing._tokens": "src/kvwire/routing/_tokens.c",
    "kvwire.indexer._answer": "src/kvwire/indexer/_answer.c",
    "kvwire.tokenize._plain": "src/kvwire/tokenize/_plain.c",
    "kvwire.tokenize._bpe": "src/kvwire/tokenize/_bpe.c",
}
#: Extra link arguments: the index's keys use the system's libxxhash (Debian: libxxhash0).
_LINK = {"kvwire.index._keys": ["-l:libxxhash.so.0"],
         "kvwire.index._tiers": ["-l:libxxhash.so.0"]}
#: Headers a module's sources include (rebuild on change; shipped in the sdist).
_DEPENDS = {"kvwire.shm._ring": ["src/kvwire/shm/_pickle5.h"],
            "kvwire.index._keys": ["src/kvwire/index/_lanes.h"],
            "kvwire.index._tiers": ["src/kvwire/index/_lanes.h"]}

ext_modules = [
    Extension(name, srcs, optional=True, extra_compile_args=["-O2", "-std=c11"],
              extra_link_args=_LINK.get(name, []), depends=_DEPENDS.get(name, []))
    for name, src in _MODULES.items()
    for srcs in [[src] if isinstance(src, str) else src]
    if os.path.exists(srcs[0]) and not os.environ.get("KVWIRE_NO_NATIVE")
]

setup(ext_modules=ext_modules)
