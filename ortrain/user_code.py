"""Which code is the user's: not installed (a script, a notebook, a local package), and
the global names a function's code reads. The graph cache hashes such code with what it
reads (``build_cache.py``); the Python-state checks watch the values it reads
(``python_state.py``)."""

from __future__ import annotations

import dis
import functools
import os
import sys
import sysconfig
import types
from pathlib import Path


def installed_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots |= {p for p in sys.path if p.endswith(("site-packages", "dist-packages"))}
    return tuple(sorted(str(Path(r).resolve()) for r in roots if r))


def is_installed(path: str) -> bool:
    resolved = str(Path(path).resolve())
    return any(resolved.startswith(root + os.sep) for root in installed_roots())


@functools.lru_cache(maxsize=1024)
def is_user_code(name: str) -> bool:
    """Whether module ``name`` is the user's (not installed: a script, a notebook, a local
    package), whose functions' code is hashed with what they read."""
    if name.split(".")[0] in ("torch", "ortrain", "builtins"):
        return False
    file = getattr(sys.modules.get(name), "__file__", None)
    return file is None or not is_installed(file)


_GLOBAL_LOADS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})


def global_names(code: types.CodeType) -> set[str]:
    """The global names ``code`` and its nested functions read: loaded as globals, not
    every name of ``co_names`` (which holds attribute names too: ``self.l`` would take a
    script's loss ``l`` for a value the forward reads)."""
    names = {str(i.argval) for i in dis.get_instructions(code) if i.opname in _GLOBAL_LOADS}
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= global_names(c)
    return names
