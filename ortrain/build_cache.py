"""Time to first step: built graphs cached on disk, and the stage a long build is in.

A trainer's first step exports the module, runs the passes and creates an ONNX Runtime
session. The first two depend only on what goes into them, so their result (the
``BuiltGraph`` records of ``ortrain/build.py``) is kept on disk, keyed by a hash of:

- the model's structure: each submodule's class and the source of the code that defines
  it (the class's file; the whole package where it is local code, a package's version
  where it is installed), its attributes (a tensor attribute by value: the export bakes it
  in), its parameters' and buffers' names, shapes, dtypes and ``requires_grad``, its hooks;
- the batch signature, ``loss_fn`` (its code and closure), every build setting;
- the libraries: ortrain's own source, torch, onnx, onnxruntime, onnxscript, onnx_ir.

Weights and buffer values are not part of the key: the exported graphs take them as
inputs (``ortrain/export.py``). Entries live in ``$XDG_CACHE_HOME/ortrain/graphs``
(``~/.cache/ortrain/graphs``); ``TrainerOptions(graph_cache=False)`` or
``ORTRAIN_GRAPH_CACHE=0`` turns the cache off, ``ORTRAIN_GRAPH_CACHE=<dir>`` moves it.
Each entry is written atomically (a temporary file renamed over it) with a SHA-256 of its
content, checked before it is unpickled (by an unpickler that makes only ortrain's build
records); a damaged entry is deleted with a warning and the graph is built again.

Only this user may write the cache (``ortrain/safe_files.py``, docs/security.md): folders
are created 0700; a folder another user owns or can write is refused (a folder the user
named raises ``UntrustedPathError`` at construction; the default one warns and the trainer
builds without a cache), and so is an entry (a symlink, another owner, group- or
other-writable: built again, with a warning): its content hash proves only that it was
written whole, not who wrote it.

A build that misses the cache holds an exclusive lock (``flock``) on a file beside the entry it
will write: another process on this machine that misses the same entry (the other ranks
of a ``torchrun`` job, which build the same graphs at the same moment) waits for it and
then loads the entry instead of building it too. A lock held longer than the build timeout
(``ORTRAIN_EXPORT_TIMEOUT``) is waited out with a warning and the graph built regardless;
a holder that dies releases it with its process.

A training graph is two entries: the exported forward of a batch signature (the label
sites the labelled-row count is read from) and the graph of that forward, settings and
labelled-row bucket; a new bucket builds from the cached forward without exporting.

While a build has run ``build_progress.PROGRESS_AFTER_S`` seconds the stage it is in (export,
passes, session) is printed on stderr, one line per stage (``TrainerOptions(build_progress=False)``:
nothing).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import errno
import functools
import hashlib
import importlib.metadata
import io
import os
import pickle
import platform
import re
import sys
import time
import types
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ortrain import nested_batch
from ortrain.build_progress import BuildProgress
from ortrain.core.errors import first_line

try:
    import fcntl
except ImportError:  # Windows: no advisory locks; each process builds its own
    fcntl = None  # type: ignore[assignment]
from ortrain.safe_files import (
    UntrustedPathError,
    atomic_write,
    private_dir,
    untrusted_file,
    untrusted_folder,
)
from ortrain.user_code import global_names, is_installed, is_user_code

if TYPE_CHECKING:
    from ortrain.build import BuiltGraph, ForwardSource, StageRecord
    from ortrain.core.build_config import BuildConfig
    from ortrain.export import LossFn
    from ortrain.length_family import LengthFamily
    from ortrain.options import TrainerOptions

T = TypeVar("T")
CACHE_ENV = "ORTRAIN_GRAPH_CACHE"
MAGIC = b"ortrain-graph-cache 1\n"
# what an entry may hold besides plain containers (the restricted unpickler's list)
_RECORDS = {
    ("ortrain.build", "BuiltGraph"),
    ("ortrain.build", "StageRecord"),
    ("ortrain.build", "ForwardSource"),
    ("ortrain.core.roles", "GraphIO"),
    ("ortrain.core.roles", "Role"),
    ("ortrain.core.names", "LabelSite"),
}
_LIBRARIES = ("torch", "onnx", "onnxruntime", "onnxruntime-gpu", "onnxscript", "onnx-ir", "numpy")
_OFF = ("0", "off", "false", "no")
_ON = ("", "1", "on", "true", "yes")


def cache_dir(option: bool | str | os.PathLike | None) -> Path | None:
    """Where entries live for ``TrainerOptions.graph_cache``; None: off.

    ``ORTRAIN_GRAPH_CACHE`` "0"/"off" turns every trainer's cache off; another value than
    "1"/"on" is the folder. An option path wins over the variable's folder."""
    env = os.environ.get(CACHE_ENV, "").strip()
    if option is False or option is None or env.lower() in _OFF:
        return None
    if option is not True:
        return Path(option)
    if env.lower() not in _ON:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg and Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "ortrain" / "graphs"


def trusted_cache_dir(option: bool | str | os.PathLike | None) -> Path | None:
    """``cache_dir(option)``, created (0700) and checked to be this user's alone; None: off.

    A folder the user named (the option, ``ORTRAIN_GRAPH_CACHE=<dir>``) that another user
    owns or can write raises ``UntrustedPathError``: they asked for it, and only they can
    fix its mode. The default folder, nobody's choice, warns and turns the cache off: a
    cache only saves time, training must not stop for it."""
    folder = cache_dir(option)
    if folder is None:
        return None
    try:
        return private_dir(folder)
    except UntrustedPathError as exc:
        named = option is not True or os.environ.get(CACHE_ENV, "").strip().lower() not in _ON
        if named:
            raise UntrustedPathError(
                f"graph cache: {exc}; `chmod go-w` it if it is yours, or name another folder "
                f"(TrainerOptions.graph_cache, {CACHE_ENV})"
            ) from None
        warnings.warn(
            f"ortrain: building without the graph cache: {exc}; `chmod go-w` it if it is "
            f"yours, or name another folder ({CACHE_ENV}=<dir>)",
            stacklevel=4,
        )
    except OSError as exc:  # a read-only home: train on, uncached
        warnings.warn(f"ortrain: could not create the graph cache ({exc})", stacklevel=4)
    return None


# --------------------------------------------------------------------------- fingerprints
@functools.lru_cache(maxsize=4096)
def _file_digest(path: str, mtime_ns: int, size: int) -> str:
    del mtime_ns, size  # the cache key: a changed file is read again
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _file_token(path: str | os.PathLike) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return f"{path}:missing"
    return f"{Path(path).name}:{_file_digest(str(path), st.st_mtime_ns, st.st_size)}"


def _tree_token(root: Path, suffixes: tuple[str, ...] = (".py",)) -> str:
    """The content of every ``suffixes`` file under ``root`` (relative names, sorted)."""
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in suffixes and p.is_file()):
        h.update(f"{path.relative_to(root)}={_file_token(path)}\n".encode())
    return h.hexdigest()


def _unshared(forward: ForwardSource) -> ForwardSource:
    """``forward`` as stored: without its signature's symbolic export (that one stays
    with the training process, which asks for it by the signature's sizes)."""
    return dataclasses.replace(forward, family=None) if forward.family is not None else forward


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.lru_cache(maxsize=1)
def library_versions() -> str:
    """Python, the machine, the libraries that export / run the passes, ortrain's source."""
    import ortrain.graph_passes

    parts = [f"python={platform.python_version()}", f"machine={platform.machine()}"]
    parts += [f"{d}={_version(d)}" for d in _LIBRARIES]
    parts.append(f"ortrain={_version('ortrain')}")
    # a development tree changes without a new version
    roots = {"ortrain": [str(Path(__file__).parent)], "graph_passes": ortrain.graph_passes.__path__}
    for name, paths in roots.items():
        for root in paths:
            parts.append(f"{name}:{_tree_token(Path(root), ('.py', '.c', '.h'))}")
    return "\n".join(parts)


def _module_code_token(name: str) -> str:
    """The code of Python module ``name`` as a build sees it: an installed package's
    version and the module's file; local code: every .py file of its top-level package."""
    mod = sys.modules.get(name)
    file = getattr(mod, "__file__", None)
    if mod is None or file is None:
        return f"{name}:?"
    top = name.split(".")[0]
    if top in ("torch", "ortrain"):  # library_versions has them
        return ""
    if is_installed(file):
        top_mod = sys.modules.get(top)
        version = _version(top) or getattr(top_mod, "__version__", None)
        return f"{name}:{version}:{_file_token(file)}"
    top_mod = sys.modules.get(top)
    roots = list(getattr(top_mod, "__path__", []) or [])
    if roots and top != "__main__":  # helpers anywhere in a local package count
        return f"{name}:" + ",".join(_tree_token(Path(r)) for r in roots)
    return f"{name}:{_file_token(file)}"


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_MAX_DEPTH = 8
# nn.Module attributes that are not what the forward computes (they grow as it runs)
_SKIPPED_ATTRS = {
    "_parameters",
    "_buffers",
    "_modules",
    "_non_persistent_buffers_set",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
    "warnings_issued",
    "_compiled_call_impl",
    "generation_config",  # an HF model's: generate() reads it, the forward does not
}
# values that differ from process to process and mean nothing to a build (hash() of a dict)
_VOLATILE_KEYS = {"_original_object_hash"}


class _Fingerprint:
    """A hash of everything a build reads besides the weights (module docstring)."""

    def __init__(self) -> None:
        self.h = hashlib.sha256()
        self.code_modules: set[str] = set()
        self.seen: dict[int, str] = {}  # id -> token of the functions and classes hashed

    def add(self, *parts: object) -> None:
        for p in parts:
            self.h.update(str(p).encode())
            self.h.update(b"\x00")

    def digest(self) -> str:
        for name in sorted(self.code_modules):
            self.add(_module_code_token(name))
        return self.h.hexdigest()

    def value(self, v: Any, depth: int = 0, path: frozenset[int] = frozenset()) -> str:
        """A string that changes when ``v`` could change the exported graph."""
        if v is None or isinstance(v, (bool, int, float, complex, str, bytes)):
            return f"{type(v).__name__}:{v!r}"
        if isinstance(v, (torch.dtype, torch.device, torch.Size, enum.Enum)):
            return repr(v)
        if depth > _MAX_DEPTH or id(v) in path:
            return f"<{type(v).__qualname__}>"
        path = path | {id(v)}
        if isinstance(v, torch.Tensor):  # an attribute, not a parameter: a graph constant
            return f"tensor{tuple(v.shape)}:{v.dtype}:{_tensor_digest(v)}"
        if isinstance(v, torch.nn.Module):  # hashed where it sits in the module tree
            return f"<module {type(v).__qualname__}>"
        if isinstance(v, (list, tuple)):
            return (
                f"{type(v).__name__}[" + ",".join(self.value(x, depth + 1, path) for x in v) + "]"
            )
        if isinstance(v, (set, frozenset)):
            return "set{" + ",".join(sorted(self.value(x, depth + 1, path) for x in v)) + "}"
        if isinstance(v, Mapping):
            items = sorted(
                f"{self.value(k, depth + 1, path)}={self.value(x, depth + 1, path)}"
                for k, x in v.items()
                if k not in _VOLATILE_KEYS
            )
            return f"{type(v).__qualname__}{{" + ",".join(items) + "}"
        if callable(v) and not isinstance(v, type):
            return self.function(v, depth, path)
        if isinstance(v, type):
            self._code_of(v)
            return f"class {v.__module__}.{v.__qualname__}"
        state = getattr(v, "__dict__", None)
        if isinstance(state, dict):
            self._code_of(type(v))
            return f"{type(v).__qualname__}(" + self.value(state, depth + 1, path) + ")"
        return _ADDRESS.sub("", repr(v))

    def function(self, fn: Callable, depth: int, path: frozenset[int]) -> str:
        if isinstance(fn, functools.partial):
            args = self.value((fn.args, fn.keywords), depth + 1, path)
            return f"partial({self.function(fn.func, depth + 1, path)},{args})"
        if isinstance(fn, types.MethodType):  # the instance: its type (a module: hashed)
            owner = fn.__self__
            return f"method({type(owner).__qualname__},{self.function(fn.__func__, depth, path)})"
        code = getattr(fn, "__code__", None)
        module = getattr(fn, "__module__", None)
        module = module if isinstance(module, str) else None
        if module:
            self.code_modules.add(module)
        name = f"{module}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
        if code is None:
            if not hasattr(fn, "__qualname__"):  # a callable object
                return self.value(getattr(fn, "__dict__", {}), depth + 1, path) + name
            return name
        if id(fn) in self.seen:  # hashed once (helpers call each other)
            return f"{name}:{self.seen[id(fn)]}"
        self.seen[id(fn)] = "<cycle>"
        cells = [c.cell_contents for c in (fn.__closure__ or ()) if _filled(c)]
        extra = self.value((fn.__defaults__, fn.__kwdefaults__, cells), depth + 1, path)
        token = f"{_code_digest(code)}:{extra}"
        if module and is_user_code(module):  # a notebook has no file: what the code reads
            token += ":" + self._globals(fn, code, depth, path)
        self.seen[id(fn)] = hashlib.sha256(token.encode()).hexdigest()
        return f"{name}:{token}"

    def _globals(self, fn: Callable, code: types.CodeType, depth: int, path: frozenset[int]) -> str:
        """The module-level functions, classes and values that ``code`` names."""
        scope = getattr(fn, "__globals__", {})
        parts = []
        for n in sorted(global_names(code)):
            if n not in scope or isinstance(scope[n], types.ModuleType):
                continue
            parts.append(f"{n}={self.value(scope[n], depth + 1, path)}")
        return ",".join(parts)

    def _code_of(self, cls: type) -> None:
        for c in cls.__mro__:
            if c is torch.nn.Module or c is object:
                break
            # a class made at run time may have no module (``__module__`` None): where it
            # came from is unknown, so its methods' code is hashed as a script's would be
            name = c.__module__ if isinstance(c.__module__, str) else None
            if name is not None:
                self.code_modules.add(name)
            if (name is None or is_user_code(name)) and id(c) not in self.seen:
                self.seen[id(c)] = "<class>"
                for k, v in sorted(vars(c).items()):
                    f = getattr(v, "__func__", getattr(v, "fget", v))
                    if isinstance(f, types.FunctionType):
                        self.add(f"{c.__qualname__}.{k}", self.function(f, 0, frozenset()))

    def module(self, module: torch.nn.Module) -> None:
        from torch.nn.modules import module as nn_module

        for name in ("_global_forward_hooks", "_global_forward_pre_hooks"):
            hooks = getattr(nn_module, name, {})
            self.add(name, self.value(list(hooks.values())))
        for name, m in module.named_modules(remove_duplicate=False):
            cls = type(m)
            self._code_of(cls)
            self.add("module", name, f"{cls.__module__}.{cls.__qualname__}", m.training)
            for k in sorted(vars(m)):
                if k not in _SKIPPED_ATTRS and not k.startswith("_forward_hooks_with"):
                    self.add(k, self.value(vars(m)[k]))
            for k, p in m._parameters.items():
                shape = None if p is None else (tuple(p.shape), p.dtype, p.requires_grad)
                self.add("param", k, shape, None if p is None else p.device.type)
            for k, b in m._buffers.items():
                shape = None if b is None else (tuple(b.shape), b.dtype, b.device.type)
                self.add("buffer", k, shape, k in m._non_persistent_buffers_set)


def _filled(cell: types.CellType) -> bool:
    try:
        cell.cell_contents  # noqa: B018 (an empty cell raises)
    except ValueError:
        return False
    return True


def _code_digest(code: types.CodeType) -> str:
    h = hashlib.sha256(code.co_code)
    h.update(repr(code.co_names).encode())
    h.update(repr(code.co_varnames).encode())
    for c in code.co_consts:
        h.update((_code_digest(c) if isinstance(c, types.CodeType) else repr(c)).encode())
    return h.hexdigest()


def _tensor_digest(v: torch.Tensor) -> str:
    """Its bytes' SHA-256 (a 0-d tensor, bfloat16 and bool included); a tensor without
    plain bytes (sparse, meta) gets its identity: no other process's key matches it."""
    try:
        data = v.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        return hashlib.sha256(data.numpy().tobytes()).hexdigest()
    except (RuntimeError, NotImplementedError, TypeError):
        return f"object {id(v)}"


def model_fingerprint(module: torch.nn.Module, loss_fn: LossFn | None) -> str:
    """The part of every key that depends on the model (and ``loss_fn``), not the batch."""
    fp = _Fingerprint()
    fp.add("default_dtype", torch.get_default_dtype())
    fp.module(module)
    fp.add("loss_fn", fp.value(loss_fn))
    return fp.digest()


def batch_token(batch: Mapping[str, Any]) -> str:
    """Names, shapes and dtypes of the batch tensors; other values by value."""
    fp = _Fingerprint()
    parts = []
    for k, v in nested_batch.flat(batch).items():
        if isinstance(v, torch.Tensor):
            parts.append(f"{k}:{tuple(v.shape)}:{v.dtype}:{v.device.type}")
        else:
            parts.append(f"{k}={fp.value(v)}")
    return ";".join(parts)


def _settings_token(settings: BuildConfig) -> str:
    """The build options and, where CPU lowerings run (BLAS products, ortrain's kernels),
    what of the cost model they read: a graph built with other thresholds
    (``ORTRAIN_CPU_COST``, another machine's L1 cache) is another entry; another core count
    or affinity mask is not."""
    if settings.target != "cpu" or not (settings.blas_gemm or settings.cpu_kernels):
        return repr(settings)
    from ortrain.graph_passes.targets.cpu.cost_model import CpuCostModel

    return f"{settings!r} {CpuCostModel.for_machine().key()}"


def _key(*parts: object) -> str:
    return hashlib.sha256("\x00".join(map(str, parts)).encode()).hexdigest()


# --------------------------------------------------------------------------- entries
class _Unpickler(pickle.Unpickler):
    """Makes ortrain's build records and plain containers, nothing else."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _RECORDS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"unexpected {module}.{name} in a graph cache entry")


class DamagedEntry(Exception):
    """A cache entry that does not read back as written."""

    verdict = "is damaged"


class UntrustedEntry(DamagedEntry):
    """A cache entry, or its folder, that another user wrote or could have written."""

    verdict = "is not trusted"


def write_entry(path: Path, key: str, value: Any) -> None:
    """``(key, value)`` pickled, with its SHA-256, atomically at ``path`` (0600, in a
    folder created 0700)."""
    data = pickle.dumps((key, value), protocol=pickle.HIGHEST_PROTOCOL)
    blob = MAGIC + hashlib.sha256(data).hexdigest().encode() + b"\n" + data
    private_dir(path.parent)
    atomic_write(path, lambda f: f.write(blob), private=True)


def _read_own(path: Path) -> bytes:
    """``path``'s bytes, where it and its folder are this user's alone; opened without
    following symlinks and checked on the open descriptors (no swap between check and read)."""
    try:
        folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UntrustedEntry(f"its folder {path.parent} is a symlink") from None
        raise
    try:
        why = untrusted_folder(os.fstat(folder))
        if why is not None:
            raise UntrustedEntry(f"its folder {path.parent}: {why}")
        try:
            fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=folder)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UntrustedEntry("it is a symlink") from None
            raise
    finally:
        os.close(folder)
    with os.fdopen(fd, "rb") as f:
        why = untrusted_file(os.fstat(f.fileno()))
        if why is not None:
            raise UntrustedEntry(why)
        return f.read()


def read_entry(path: Path, key: str) -> Any:
    """The value stored under ``key`` at ``path``; raises DamagedEntry (with why) where the
    file is not what ``write_entry`` wrote for that key, UntrustedEntry where another user
    wrote it or could have."""
    blob = _read_own(path)
    if not blob.startswith(MAGIC):
        raise DamagedEntry("not a graph cache entry")
    head, sep, data = blob[len(MAGIC) :].partition(b"\n")
    if not sep or hashlib.sha256(data).hexdigest().encode() != head:
        raise DamagedEntry("content hash mismatch")
    try:
        stored_key, value = _Unpickler(io.BytesIO(data)).load()
    except Exception as exc:
        raise DamagedEntry(f"unreadable: {exc}") from exc
    if stored_key != key:
        raise DamagedEntry("stored under another key")
    return value


class GraphCache:
    """A trainer's built graphs on disk (module docstring); off: builds run as before."""

    def __init__(
        self, options: TrainerOptions, module: torch.nn.Module, loss_fn: LossFn | None
    ) -> None:
        # graphs saved after each pass (save_graphs_dir) need the passes to run
        self.dir = None if options.save_graphs_dir else trusted_cache_dir(options.graph_cache)
        self.progress_enabled = options.build_progress
        self.module = module
        self.loss_fn = loss_fn
        self.hits = 0  # graphs taken from the cache instead of built
        # the build seconds those graphs took where they were built, less their loads here:
        # what a build costs this model (``deferred_builds.py`` prices new shapes by it)
        self.saved_seconds = 0.0
        self.session_log: list[StageRecord] = []  # seconds each ONNX Runtime session took
        self.progress: BuildProgress | None = None
        self._model_key: str | None = None

    @property
    def enabled(self) -> bool:
        """Whether graphs are kept and loaded: a folder, and a key for the model. A model
        whose key cannot be made (an object its forward reads that will not be looked
        into) has its graphs built every time, with a warning: an optional cache is no
        reason to stop training."""
        if self.dir is None:
            return False
        if self._model_key is None:
            try:
                self._model_key = model_fingerprint(self.module, self.loss_fn)
            except Exception as exc:
                warnings.warn(
                    f"ortrain: the graph cache is off for {type(self.module).__name__}: its "
                    f"key could not be made ({type(exc).__name__}: {first_line(exc)}); its "
                    "graphs are built, not kept",
                    stacklevel=2,
                )
                self.dir = None
                return False
        return True

    def _base(self, graph: str, batch: Mapping[str, Any]) -> str:
        if self._model_key is None:  # once: the module keeps its structure while it trains
            self._model_key = model_fingerprint(self.module, self.loss_fn)
        return _key(graph, library_versions(), self._model_key, batch_token(batch))

    def forget_model_key(self) -> None:
        """The module changed what its key saw (a sub-module's mode): key it again."""
        self._model_key = None

    def _path(self, key: str) -> Path:
        assert self.dir is not None
        return self.dir / key[:2] / f"{key}.pkl"

    def load(self, key: str) -> Any:
        """The entry under ``key``, or None (absent; damaged: deleted, with a warning)."""
        path = self._path(key)
        try:
            value = read_entry(path, key)
        except FileNotFoundError:
            return None
        except (OSError, DamagedEntry) as exc:
            verdict = exc.verdict if isinstance(exc, DamagedEntry) else DamagedEntry.verdict
            warnings.warn(
                f"ortrain: graph cache entry {path} {verdict} ({exc}); building the graph again",
                stacklevel=4,
            )
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # last used: what to delete first when pruning by hand
        return value

    @contextlib.contextmanager
    def building(self, key: str) -> Iterator[None]:
        """Held while this process builds what goes under ``key`` (module docstring)."""
        if fcntl is None:
            yield
            return
        path = self._path(key).with_suffix(".lock")
        try:
            private_dir(path.parent)
            flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
            fd = os.open(path, flags, 0o600)
        except (OSError, UntrustedPathError):  # no lock: build as if alone
            yield
            return
        try:
            self._lock(fd, path)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _lock(self, fd: int, path: Path) -> None:
        assert fcntl is not None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        progress = self.progress or self._progress("training")
        deadline = time.monotonic() + float(os.environ.get("ORTRAIN_EXPORT_TIMEOUT", "1800"))
        with progress.running():
            progress.stage("waiting for another process building it")
            while time.monotonic() < deadline:
                time.sleep(0.05)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return
                except BlockingIOError:
                    continue
        warnings.warn(
            f"ortrain: another process has held {path} past the build timeout; building the "
            "graph here as well",
            stacklevel=5,
        )

    def recall(self, what: str, batch: Mapping[str, Any]) -> tuple[Any] | None:
        """A small analysis of the model at ``batch``'s signature (plain values, not a
        graph) that ``remember`` kept, as a 1-tuple; None: not kept (or the cache off).
        Keyed like the graphs (the model's structure and code, the loss, the library
        versions), so what was found once holds until one of those changes."""
        if not self.enabled:
            return None
        found = self.load(self._base(what, batch))
        return (found["value"],) if isinstance(found, dict) and "value" in found else None

    def remember(self, what: str, batch: Mapping[str, Any], value: Any) -> None:
        if self.enabled:
            self.store(self._base(what, batch), {"value": value})

    def store(self, key: str, value: Any) -> None:
        try:
            write_entry(self._path(key), key, value)
        except OSError as exc:  # a read-only or full disk: train on, uncached
            warnings.warn(f"ortrain: could not write the graph cache ({exc})", stacklevel=4)

    def _progress(self, what: str) -> BuildProgress:
        name = type(self.module).__name__
        self.progress = BuildProgress(f"{name} {what} graph", self.progress_enabled)
        return self.progress

    def _run(self, run: Callable[[Callable[[], T]], T], job: Callable[[], T]) -> T:
        progress = self.progress
        assert progress is not None

        def tracked() -> T:
            with progress.running():
                return job()

        return run(tracked)

    def build_train(
        self,
        run: Callable[[Callable[[], Any]], Any],
        module: torch.nn.Module,
        batch: Mapping[str, Any],
        loss_fn: LossFn | None,
        settings: BuildConfig,
        forward: ForwardSource | None,
        first: int,
        fresh: bool = False,
        family: LengthFamily | None = None,
    ) -> tuple[ForwardSource, tuple, BuiltGraph]:
        """``ortrain.build.build_train``'s result, from the cache where it has it;
        ``fresh``: built anew and stored over the entry (a cached graph that failed its
        first-step check against eager, ``ortrain/verify.py``); ``family``: an export
        is taken from the symbolic one of the signature's sizes where it can be."""
        from ortrain.build import build_train

        self._progress("training")
        if not self.enabled or fresh:
            if fresh and self.enabled:
                job = functools.partial(
                    build_train, module, batch, loss_fn, settings, None, first, family
                )
                new_forward, rows, built = self._run(run, job)
                fkey = _key("forward", self._base("train", batch), settings.optimize)
                self.store(fkey, _unshared(new_forward))
                self.store(_key("graph", fkey, _settings_token(settings), rows), built)
                return new_forward, rows, built
            return self._run(
                run,
                functools.partial(
                    build_train, module, batch, loss_fn, settings, forward, first, family
                ),
            )
        t = time.perf_counter()
        # a build that raised UpdateInBackwardError ("auto" then builds without the update
        # in the backward) is stored under "refused": deterministic, so the next run skips
        # straight to that
        fkey = _key("forward", self._base("train", batch), settings.optimize)
        found = self._load_train(fkey, batch, settings, forward, t)
        if isinstance(found, tuple):
            return found
        with self.building(fkey):
            # another process may have built it while this one waited for the lock
            found = self._load_train(fkey, batch, settings, forward, t)
            if isinstance(found, tuple):
                return found
            return self._build_train(
                run, module, batch, loss_fn, settings, found, first, fkey, family
            )

    def holds_train(self, batch: Mapping[str, Any], settings: BuildConfig) -> bool:
        """Whether the cache has an entry for ``batch``'s exported forward (its graph is a
        load away, not a build), without reading it."""
        if not self.enabled:
            return False
        fkey = _key("forward", self._base("train", batch), settings.optimize)
        return self._path(fkey).is_file()

    def _load_train(
        self,
        fkey: str,
        batch: Mapping[str, Any],
        settings: BuildConfig,
        forward: ForwardSource | None,
        start: float,
    ) -> tuple[ForwardSource, tuple, BuiltGraph] | ForwardSource | None:
        """The cached (forward, rows, graph) of ``fkey``; where only the forward is there,
        that forward; else None. Raises a cached refusal."""
        from ortrain.build import label_rows
        from ortrain.core.names import UpdateInBackwardError

        refused = self.load(_key("refused", fkey, _settings_token(settings)))
        if isinstance(refused, str):
            raise UpdateInBackwardError(refused)
        if forward is None:
            forward = self.load(fkey)
        if forward is not None:
            rows = label_rows(forward.sites, batch, headroom=True)
            built = self.load(_key("graph", fkey, _settings_token(settings), rows))
            if built is not None:
                return forward, rows, self._hit(built, "train", start)
        return forward

    def _build_train(
        self,
        run: Callable[[Callable[[], Any]], Any],
        module: torch.nn.Module,
        batch: Mapping[str, Any],
        loss_fn: LossFn | None,
        settings: BuildConfig,
        forward: ForwardSource | None,
        first: int,
        fkey: str,
        family: LengthFamily | None = None,
    ) -> tuple[ForwardSource, tuple, BuiltGraph]:
        from ortrain.build import build_train
        from ortrain.core.names import UpdateInBackwardError

        refused_key = _key("refused", fkey, _settings_token(settings))
        exports = forward is None
        job = functools.partial(
            build_train, module, batch, loss_fn, settings, forward, first, family
        )
        try:
            new_forward, rows, built = self._run(run, job)
        except UpdateInBackwardError as exc:
            self.store(refused_key, str(exc))
            raise
        if exports:
            self.store(fkey, _unshared(new_forward))
        self.store(_key("graph", fkey, _settings_token(settings), rows), built)
        return new_forward, rows, built

    def build_eval(
        self,
        run: Callable[[Callable[[], Any]], Any],
        module: torch.nn.Module,
        batch: Mapping[str, Any],
        loss_fn: LossFn | None,
        settings: BuildConfig,
        first: int,
        forward: ForwardSource | None = None,
        fresh: bool = False,
    ) -> BuiltGraph:
        """``ortrain.build.build_eval``'s result, from the cache where it has it (``fresh``:
        built anew over the entry, as for training graphs)."""
        from ortrain.build import build_eval

        self._progress("eval")
        job = functools.partial(build_eval, module, batch, loss_fn, settings, first, forward)
        if not self.enabled:
            return self._run(run, job)
        t = time.perf_counter()
        key = _key("eval", self._base("eval", batch), _settings_token(settings))
        built = None if fresh else self.load(key)
        if built is not None:
            return self._hit(built, "eval", t)
        with self.building(key):
            built = None if fresh else self.load(key)
            if built is not None:
                return self._hit(built, "eval", t)
            built = self._run(run, job)
            self.store(key, built)
        return built

    def _hit(self, built: BuiltGraph, graph: str, start: float) -> BuiltGraph:
        from ortrain.build import StageRecord

        self.hits += 1
        load = time.perf_counter() - start
        self.saved_seconds += max(0.0, sum(r.seconds for r in built.log) - load)
        # this process's log: the load, not the stages of the build that made the entry
        built.log = [StageRecord(graph, "cache", load, 0, 0)]
        return built

    @contextlib.contextmanager
    def session_stage(self, graph: str) -> Iterator[None]:
        """Around a built graph's session creation: its record in ``session_log`` (the
        build log holds the graph's own stages) and its progress line."""
        from ortrain.build import StageRecord

        progress = self.progress or self._progress(graph)
        t = time.perf_counter()
        with progress.running():
            progress.stage("session")
            yield
        self.session_log.append(StageRecord(graph, "session", time.perf_counter() - t, 0, 0))
        note = f" (kept in {self.dir} for the next run)" if self.enabled else ""
        progress.done(note)
        self.progress = None
