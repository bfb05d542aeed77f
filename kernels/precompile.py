"""Compile a model's Triton kernels before its first forward, all at once, in worker processes.

A cold ``optimize()`` spent almost all its time in Triton compiling one kernel specialization after the
other, as its example forward reached each launch. Here that forward runs twice:

1. collecting (:func:`collecting`): Triton's ``jit_cache_hook`` sees every launch that would compile and
   records its :class:`Variant` -- the kernel, its constexprs, its signature with Triton's own
   specializations (divisibility by 16 of pointers and ints, ints equal to 1), warps and stages -- and
   stops it: nothing compiles, nothing runs on the GPU. Each variant goes, as soon as it is found, to
   one of the worker processes (:class:`Workers`), which runs ``triton.compile(ASTSource(kernel,
   signature, constexprs, attrs), target, options)`` -- what the JIT itself calls, so the result lands in
   Triton's on-disk cache under the key the JIT looks up -- with no GPU context (``CUDA_VISIBLE_DEVICES``
   is empty in the workers);
2. once the workers are done, the real forward (with its CUDA graph recording) finds every kernel in
   the cache and only loads it.

The key is the point: a worker's compile helps only if it is filed under the key this process's JIT
will compute. Everything in that key is recorded from the launch itself except the kernel's source key
(``JITFunction.cache_key``), which each process computes -- and which on Triton 3.6 depends on the order
the process hashed its kernels in (:func:`adopt_function_key`). So the source key is recorded too and
the worker adopts it; each variant also carries the full key its JIT will look up
(:func:`disk_key`, Triton's own ``get_cache_key``), and a worker that files a variant under another
one is reported, with the key fields that differ (:func:`key_parts`), instead of missing silently.

Why ahead and in parallel rather than lazily in the background: the first forward needs every kernel of
the model (a CUDA graph is recorded over all of them), so a lazy compile only moves the wait into that
call; and compiling is CPU-bound Python and MLIR work, which threads of one process do not spread over
the cores. Why processes started by :class:`Workers` rather than a ``multiprocessing`` pool: a spawned
``multiprocessing`` child re-imports the user's ``__main__``, which re-runs a script that calls
``optimize()`` without a ``__main__`` guard. The workers here start one of two ways
(``FUSER_COMPILE_START``, :func:`start_method`): ``fork`` (the default on Linux) forks this process, which
has torch and the kernels imported already, so the workers are ready at once; ``spawn`` starts one fresh
interpreter on this process's ``sys.path`` that imports the kernels (about 5 s on the H200 machine, most of
it torch) and then forks the others (:func:`worker_main`). Either way N workers cost at most one import,
and ``optimize()`` starts them before its graph passes.

A variant a worker fails to compile is named in a warning (kernel, constexprs, warps, stages) and
compiled in this process instead; where that fails too, its launch raises Triton's error as it would have
without this module. A worker that does not answer within ``FUSER_COMPILE_TIMEOUT_S`` (default 300 s;
:func:`compile_timeout`) is stopped and counts as failed on its variant. ``FUSER_COMPILE_WORKERS`` sets
the number of workers (``auto``, the default: one per core; 0 compiles nothing ahead, see
:func:`default_workers`).

Without a GPU, :func:`collecting` with ``simulate="sm90"`` lists the variants a model would need on that
architecture from an interpreter run (fuser.kernels.launch.simulating): how the specializations were
counted and cut. Launches that do not go through fuser.kernels.launch (the pool kernels) still run in
the interpreter there and are not listed; on a GPU the hook sees them too.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib
import json
import os
import pickle
import queue
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, BinaryIO

from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver

from . import autotune, launch
from .autotune import Progress

WORKERS_ENV = "FUSER_COMPILE_WORKERS"
START_ENV = "FUSER_COMPILE_START"  # how the workers start: "fork" or "spawn" (start_method)
TIMEOUT_ENV = "FUSER_COMPILE_TIMEOUT_S"  # how long a worker may take to answer (compile_timeout)
# The longest compile measured is about 3 s (the detect head on the CPU machine, under load); a spawned
# worker's start about 6 s. Five minutes only catches what will never answer.
DEFAULT_TIMEOUT_S = 300.0
PIPES_ENV = "FUSER_WORKER_PIPES"  # a worker interpreter's pipe pairs, one per worker (_Server)
MAX_WORKERS = 32


@dataclass(frozen=True)
class Variant:
    """One compiled specialization of a ``@triton.jit`` kernel, in the form ``triton.compile`` takes.

    ``kernel`` is ``"module:qualname"`` (importable, so a worker can find it), ``signature`` maps each
    parameter to its Triton type ("*fp32", "i32", "constexpr", "tensordesc<...>"), ``constants`` and
    ``attrs`` map argument paths to constexpr values and to specialization attributes
    (``tt.divisibility`` 16), ``options`` are the backend options (``num_warps``, ``num_stages``, ...),
    ``target`` the GPU it is compiled for, ``key`` the JIT's own cache key of the launch (unique per
    variant and target). ``function_key`` is the kernel's source key (``JITFunction.cache_key``) in the
    process that listed it, which a worker adopts (:func:`adopt_function_key`), and ``cache_hash`` the
    on-disk cache key that process's JIT will look up (:func:`disk_key`), against which a worker's
    result is checked.
    """

    kernel: str
    signature: dict[str, Any]
    constants: dict[Any, Any]
    attrs: dict[Any, Any]
    options: dict[str, Any]
    target: GPUTarget
    declared: tuple[str, ...] = ()  # the parameters the kernel declares tl.constexpr
    key: str = field(default="", repr=False)
    function_key: str = field(default="", repr=False)  # the kernel's JITFunction.cache_key where it was listed
    cache_hash: str = field(default="", repr=False)  # Triton's on-disk key of it there ("": not computable)
    launcher: bool = True  # also build its C launcher (build_launcher): the first variant of a launcher_key

    @property
    def name(self) -> str:
        return self.kernel.rsplit(":", 1)[-1].rsplit(".", 1)[-1]

    def _param(self, path: Any) -> str:
        index = path[0] if isinstance(path, tuple) else path
        names = list(self.signature)
        return names[index] if isinstance(index, int) and index < len(names) else str(index)

    def launcher_key(self) -> tuple[Any, ...]:
        """What a per-signature C launcher (:func:`build_launcher`) is generated from: the parameters' types
        and which of them are compiled in as constants; with tensor descriptors also the constants' values
        (the descriptors' block shapes are tile constexprs). Variants of one key share one launcher."""
        described = any("tensordesc" in str(kind) for kind in self.signature.values())
        constants = sorted((str(path), str(value) if described else "") for path, value in self.constants.items())
        return tuple(self.signature.items()), tuple(constants)

    def constexprs(self) -> dict[str, Any]:
        """The declared constexprs (tile sizes, epilogue switches) by name; not the ints Triton made
        constant because they equal 1 (those are in :meth:`specialized`)."""
        out = {}
        for path, value in self.constants.items():
            name = self._param(path)
            if name in self.declared:
                out[name] = value
        return out

    def specialized(self) -> dict[str, str]:
        """The runtime arguments Triton specialized, by name: "16" (divisible by 16) or "=1" (an int
        equal to 1, compiled in as a constant)."""
        out = {}
        for path, value in self.constants.items():
            name = self._param(path)
            if name not in self.declared:
                out[name] = f"={value}"
        for path, attrs in self.attrs.items():
            for attr in attrs:
                if attr[0] == "tt.divisibility":
                    out[self._param(path)] = str(attr[1])
        return out

    def describe(self) -> str:
        """One line: kernel, constexprs, warps and stages, then the specialized runtime arguments."""
        constexprs = " ".join(f"{k}={v}" for k, v in self.constexprs().items())
        special = " ".join(f"{k}:{v}" for k, v in self.specialized().items())
        tail = f"w{self.options.get('num_warps')} s{self.options.get('num_stages')}"
        return f"{self.name}[{constexprs} {tail}]({special})"


def _tuples(value: Any) -> Any:
    """JSON gives lists where the options held tuples; the options' hash is over their text."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _variant(jit_function: Any, key: Any, compile_args: dict[str, Any], target: GPUTarget) -> Variant:
    options = json.loads(compile_args["specialization_data"])["options"]
    variant = Variant(
        kernel=f"{jit_function.fn.__module__}:{jit_function.fn.__qualname__}",
        signature=dict(compile_args["signature"]),
        constants=dict(compile_args["constants"]),
        attrs=dict(compile_args["configs"][0]),
        options={k: _tuples(v) for k, v in options.items()},
        target=target,
        declared=tuple(p.name for p in jit_function.params if p.is_constexpr),
        key=str(key),
        function_key=jit_function.cache_key,  # computed now, it is the key this process's compiles use
    )
    return replace(variant, cache_hash=disk_key(variant, jit_function))


class _TargetOnlyDriver:
    """Enough of a Triton driver for the JIT to bind and specialize launches for ``target`` on a machine
    without that GPU; the collecting hook stops each launch before anything would need a device."""

    def __init__(self, target: GPUTarget) -> None:
        self.target = target

    def get_current_target(self) -> GPUTarget:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> Any:
        import torch

        return torch.device("cpu")


@contextlib.contextmanager
def target_only_driver(target: GPUTarget) -> Iterator[None]:
    """Triton's active driver replaced by one that only knows ``target`` (see :class:`_TargetOnlyDriver`)."""
    previous = getattr(driver, "_active", None)
    driver.set_active(_TargetOnlyDriver(target))
    try:
        yield
    finally:
        driver._active = previous


def parse_arch(arch: str) -> GPUTarget:
    """``"sm90"`` -> the CUDA target Triton compiles for on that architecture."""
    if not (arch.startswith("sm") and arch[2:].isdigit()):
        raise ValueError(f"arch must be like 'sm90', got {arch!r}")
    return GPUTarget("cuda", int(arch[2:]), 32)


@contextlib.contextmanager
def collecting(
    simulate: str | None = None, on_variant: Callable[[Variant], None] | None = None
) -> Iterator[list[Variant]]:
    """Within: every Triton launch that would compile is recorded (once per variant, in launch order)
    and skipped: the kernel neither compiles nor runs, so its outputs are left unwritten. Launches of
    kernels this process already compiled run as usual.

    ``simulate="sm90"``: plan and specialize as on that GPU on a machine without it (the launchers get CPU
    tensors under ``interpret=True``; see :func:`fuser.kernels.launch.simulating`). Only this thread's
    launches are collected; other threads' compile and run as usual. ``on_variant`` is called with each
    new variant as it is found (optimize() starts compiling it while the forward goes on).
    """
    found: dict[tuple[str, str], Variant] = {}
    variants: list[Variant] = []
    seen: dict[int, Any] = {}  # the JIT functions launched

    previous = knobs.runtime.jit_cache_hook
    owner = threading.get_ident()

    def hook(*, key: Any, fn: Any, compile: dict[str, Any], **kwargs: Any) -> Any:
        if threading.get_ident() != owner:  # another thread's launch: compiled and run as usual
            return previous(key=key, fn=fn, compile=compile, **kwargs) if previous is not None else None
        target = driver.active.get_current_target()  # the launch's device is current here
        seen[id(fn.jit_function)] = fn.jit_function
        ident = (str(key), repr(target))
        if ident not in found:
            found[ident] = _variant(fn.jit_function, key, compile, target)
            variants.append(found[ident])
            if on_variant is not None:
                on_variant(found[ident])
        return True

    with contextlib.ExitStack() as stack:
        if simulate is not None:
            stack.enter_context(target_only_driver(parse_arch(simulate)))
            stack.enter_context(launch.simulating(simulate))
        knobs.runtime.jit_cache_hook = hook
        try:
            yield variants
        finally:
            knobs.runtime.jit_cache_hook = previous
            if simulate is not None:  # the binders made for the pretended target must not serve a real GPU
                for jit_function in seen.values():
                    jit_function.device_caches.clear()


# --- compiling -------------------------------------------------------------------------------------------


def _resolve(kernel: str) -> Any:
    module, _, qualname = kernel.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _source(variant: Variant, function: Any) -> Any:
    """The compile source the JIT itself builds for ``function``: a Gluon kernel's (conv_halo.py) is a
    GluonASTSource, whose IR and cache key differ from a Triton kernel's."""
    if function.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource

        return GluonASTSource(function, variant.signature, variant.constants, variant.attrs)
    from triton.compiler import ASTSource

    return ASTSource(function, variant.signature, variant.constants, variant.attrs)


def key_parts(variant: Variant, function: Any = None) -> dict[str, str]:
    """:func:`cache_key_parts` of ``variant`` as ``triton.compile`` would file it in this process."""
    from triton.compiler import compiler as tc

    function = _resolve(variant.kernel) if function is None else function
    backend = tc.make_backend(variant.target)
    options = backend.parse_options(dict(variant.options))
    return cache_key_parts(_source(variant, function), backend, options, tc.get_cache_invalidating_env_vars())


def cache_key_parts(src: Any, backend: Any, options: Any, env_vars: dict[str, str]) -> dict[str, str]:
    """What Triton's on-disk cache key of a compile is made of, field by field (the arguments are those
    of Triton's ``get_cache_key``): the kernel's source key, the specialization (attributes, signature,
    constants), the backend's and each option's share, the cache-invalidating environment and Triton's
    own build; ``hash`` is the key itself, as ``triton.compile`` computes it. Two processes that disagree
    on ``hash`` disagree on a named field: that is what a miss is diagnosed by."""
    from triton.compiler import compiler as tc
    from triton.runtime.cache import triton_key

    parts = {
        "function": src.fn.cache_key,
        "attrs": str(src.attrs),
        "signature": str(sorted(src.signature.items())),
        "constants": str(sorted(src.constants.items())),
        "backend": backend.hash(),
        "env": str(sorted(env_vars.items())),
        "triton": triton_key(),
    }
    parts.update({f"options.{name}": repr(value) for name, value in sorted(options.__dict__.items())})
    parts["hash"] = hashlib.sha256(tc.get_cache_key(src, backend, options, env_vars).encode("utf-8")).hexdigest()
    return parts


def disk_key(variant: Variant, function: Any = None) -> str:
    """The key under which Triton's cache holds ``variant`` compiled in this process (what the JIT looks
    up at its launch); "" where this Triton's key cannot be computed here (a backend or a Triton
    without these functions): the workers' results are then not checked."""
    try:
        return key_parts(variant, function)["hash"]
    except Exception:
        return ""


def adopt_function_key(function: Any, key: str) -> bool:
    """Give ``function`` (a ``JITFunction``) the source key ``key`` from the process that listed its
    variants, where this process computed another; True where it did.

    Triton 3.6 computes a kernel's key over the ``tl.constexpr`` globals its ``@triton.jit`` helpers use
    -- but merges a helper's globals before computing that helper's key, so it counts only the helpers
    whose keys this process computed earlier, for another kernel. One kernel's key then depends on which
    kernels the process compiled before it: a worker that compiled the GEMM first and the example
    forward that compiled a conv (sharing the epilogue helpers) first disagree, and the JIT misses what
    the worker compiled (later Triton computes the helper's key first). The source is the same file in
    both processes, so the binary is the same: the worker files it under the listing process's key."""
    if not key or function.cache_key == key:
        return False
    function.hash = key
    return True


@dataclass(frozen=True)
class Compiled:
    """One variant compiled into the cache: seconds, the key it is filed under, whether the worker had to
    adopt the listing process's source key (:func:`adopt_function_key`), where that key is not the
    one the listing process computed (``Variant.cache_hash``) the worker's :func:`key_parts`, and whether
    it also built the variant's C launcher (:func:`build_launcher`)."""

    seconds: float
    cache_hash: str = ""
    adopted: bool = False
    parts: dict[str, str] | None = None
    launcher: bool = False

    def differs(self, variant: Variant) -> list[str]:
        """The key fields on which this process and the worker disagree for ``variant``."""
        if self.parts is None:
            return []
        ours = key_parts(variant)
        return [name for name in ours if name != "hash" and ours.get(name) != self.parts.get(name)]


def compile_one(variant: Variant) -> Compiled:
    """Compile ``variant`` into Triton's cache (a no-op where it is there) under the key the listing
    process's JIT looks up."""
    import triton

    start = time.perf_counter()
    function = _resolve(variant.kernel)
    adopted = adopt_function_key(function, variant.function_key)
    compiled = triton.compile(_source(variant, function), target=variant.target, options=dict(variant.options))
    launcher = False
    if variant.launcher:
        with contextlib.suppress(Exception):  # the listing process builds it at the launch, as without this module
            launcher = build_launcher(variant, compiled)
    seconds, filed = time.perf_counter() - start, str(getattr(compiled, "hash", ""))
    parts = None
    if variant.cache_hash and filed and filed != variant.cache_hash:
        with contextlib.suppress(Exception):
            parts = key_parts(variant, function)
    return Compiled(seconds, filed, adopted, parts, launcher)


def build_launcher(variant: Variant, compiled: Any) -> bool:
    """Build ``compiled``'s C launcher into Triton's cache where this Triton compiles one per kernel
    signature; True where it did.

    Triton up to 3.8 generates a C launcher per signature (``make_launcher``) and compiles it with the
    system C compiler when the kernel first loads, in the loading process: a cold optimize() of YOLOv8n
    on the H200 (triton 3.6) waited about 4 s on those compiles in its first forward, one after the
    other, after the workers were done. Built here, the first forward finds each in the cache (keyed by
    the launcher's source, which depends only on the signature and constants the worker compiled with).
    Later Triton launches every kernel through one generic launcher: nothing to build."""
    if variant.target.backend != "cuda":
        return False
    from triton.backends.nvidia import driver as nvidia_driver

    if not hasattr(nvidia_driver, "make_launcher"):
        return False
    nvidia_driver.CudaLauncher(compiled.src, compiled.metadata)
    return True


def default_workers() -> int:
    """``FUSER_COMPILE_WORKERS`` (``auto``, the default: one per CPU core this process may use, at most 32;
    0: compile nothing ahead, each kernel compiles at its first launch).

    On by default since the same-run measurement on the H200 (triton 3.6, 16 cores, empty caches): cold
    optimize() of YOLOv8n 13.9 s with the workers against 32.1 s without, ResNet-50 10.1 against 18.4,
    every variant found by the JIT's lookup (benchmarks/compile_ahead_check.py --baseline, kernels/NOTES.md)."""
    env = os.environ.get(WORKERS_ENV, "auto")
    if env != "auto":
        try:
            return max(0, int(env))
        except ValueError:
            raise ValueError(
                f"{WORKERS_ENV} must be a whole number of worker processes or 'auto', got {env!r}"
            ) from None
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, cores))


def compile_timeout() -> float:
    """How long a worker may take to answer (``FUSER_COMPILE_TIMEOUT_S``, default :data:`DEFAULT_TIMEOUT_S`): to
    be ready, or to compile one variant. A worker past it is stopped and its variant compiled in this process
    after a warning, like any variant a worker failed on."""
    value = os.environ.get(TIMEOUT_ENV, "")
    try:
        limit = float(value) if value else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds, got {value!r}") from None
    if not limit > 0:
        raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds above 0, got {value!r}")
    return limit


def start_method() -> str:
    """How compile workers start (``FUSER_COMPILE_START``): ``fork`` (the default where this process can
    fork, on Linux) or ``spawn`` (a fresh interpreter imports the kernels first; elsewhere the only way).
    See :class:`_Server`."""
    can_fork = hasattr(os, "fork") and sys.platform.startswith("linux")
    method = os.environ.get(START_ENV, "fork" if can_fork else "spawn")
    if method not in ("fork", "spawn"):
        raise ValueError(f"{START_ENV} must be 'fork' or 'spawn', got {method!r}")
    return method if can_fork else "spawn"


class _Server:
    """The process behind a pool of workers: it forks a worker per pipe pair beyond its own and serves the
    last pair itself (:func:`_serve_all`), in its own process group, so that :meth:`close` stops them all.

    It starts as ``start`` says (:func:`start_method`):

    - ``"fork"``: a fork of this process, which has torch and the kernels imported, so it is ready at
      once. Measured on the H200's 16 cores, the fresh interpreter below was ready 4.8-6.2 s into
      optimize(), while the collecting forward had listed every variant by 1.9 s (gpu-models-2026-12-02b.json;
      kernels/NOTES.md, version 10): its import is the wait. This process may have started CUDA and other
      threads; the fork runs only Python and Triton's compiler, never CUDA (torch refuses CUDA in a forked
      child with an error, and ``CUDA_VISIBLE_DEVICES`` is emptied for anything it starts). It keeps only
      its own pipes and log of this process's open files (a file lock or socket of the user's is not held
      open by it), and it never collects the objects it inherited, so no finalizer of this process's
      (a CUDA tensor's, a file's) runs twice. PyTorch's DataLoader workers are forked the same way. A
      fork copies only the thread that forks: a process that compiles Triton kernels in another thread
      while it calls optimize() should use ``spawn`` (a lock that thread held would stay held in the fork).
    - ``"spawn"``: one fresh interpreter on this process's ``sys.path`` (:func:`worker_main`) imports the
      kernels first, with ``CUDA_VISIBLE_DEVICES`` empty; Inductor's compile workers are made so.
    """

    def __init__(self, env: dict[str, str], workers: int, start: str = "spawn") -> None:
        self.log = tempfile.TemporaryFile()  # noqa: SIM115 (closed in close(), with the process)
        ours, theirs = [], []  # per worker: (jobs writer, results reader) here, (jobs reader, results writer) there
        for _ in range(workers):
            jobs_r, jobs_w = os.pipe()
            results_r, results_w = os.pipe()
            ours.append((jobs_w, results_r))
            theirs.append((jobs_r, results_w))
        passed = [fd for pair in theirs for fd in pair]
        self.process: subprocess.Popen[bytes] | None = None  # the spawned interpreter (None: a fork)
        try:
            self.pid = self._fork(theirs, passed) if start == "fork" else self._spawn(env, theirs, passed)
        except OSError:
            for fd in passed + [fd for pair in ours for fd in pair]:
                os.close(fd)
            self.log.close()
            raise
        for fd in passed:
            os.close(fd)
        self.workers = [_Worker(self, jobs_w, results_r) for jobs_w, results_r in ours]

    def _spawn(self, env: dict[str, str], theirs: list[tuple[int, int]], passed: list[int]) -> int:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _WORKER_BOOT],
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=self.log,
            env={**env, PIPES_ENV: json.dumps(theirs)},
            pass_fds=passed,
            start_new_session=True,
        )
        return self.process.pid

    def _fork(self, theirs: list[tuple[int, int]], passed: list[int]) -> int:
        _wait_key_here()  # no thread of ours is inside an import when this process forks
        for stream in (sys.stdout, sys.stderr):  # else the fork's first write repeats what is buffered here
            with contextlib.suppress(Exception):
                stream.flush()
        with warnings.catch_warnings():  # Python 3.12 warns on any fork of a process with threads: see above
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            try:
                forked = time.monotonic()
                gc.freeze()  # what this process made is never collected there
                os.setpgid(0, 0)  # its own group (both sides set it: close() may come first), out of the terminal's
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                os.dup2(self.log.fileno(), 1)
                os.dup2(self.log.fileno(), 2)
                _close_all_but({0, 1, 2, self.log.fileno(), *passed})
                # this process's streams may be objects that write elsewhere (a notebook's): plain files here
                sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 (ended by os._exit)
                sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
                os.environ["CUDA_VISIBLE_DEVICES"] = ""
                _serve_all(theirs, {"fork": forked})
            except BaseException:
                traceback.print_exc()  # into the log, which names it where a worker stops
            finally:
                os._exit(0)
        with contextlib.suppress(OSError):  # it may have set it already, or died
            os.setpgid(pid, pid)
        return pid

    def log_tail(self) -> str:
        self.log.seek(0)
        lines = self.log.read().decode(errors="replace").strip().splitlines()
        return " | ".join(lines[-3:]) or "no output"

    def close(self) -> None:
        """Stop it and its workers now (they keep no state; one still starting need not finish). Killed
        before their pipes close here: a feeding thread still reading a reply then sees an end of file."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        if self.process is not None:
            self.process.wait()
        else:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
        for worker in self.workers:
            worker.close()
        self.log.close()


class _Worker:
    """One worker of a :class:`_Server`: pickled variants in on one pipe, pickled results out on another;
    the first message it sends says when it was ready."""

    def __init__(self, server: _Server, jobs: int, results: int) -> None:
        self.server = server
        self.jobs = os.fdopen(jobs, "wb")
        self.results = os.fdopen(results, "rb")
        self.ready_at: float | None = None  # time.monotonic() when it had imported the kernels
        self.boot: dict[str, float] = {}  # its start's steps before that: time.monotonic() at each
        self.pid: int | None = None
        self.dead = False

    def wait_ready(self) -> None:
        """Read the worker's first message (when it was ready, its process id, the steps of its start),
        once."""
        if self.ready_at is None:
            _, self.ready_at, self.pid, self.boot = self._answer()

    def compile(self, variant: Variant) -> Compiled:
        try:
            self.wait_ready()
            pickle.dump(variant, self.jobs)
            self.jobs.flush()
            status, value = self._answer()
        except TimeoutError as error:  # before OSError, its base class
            self.dead = True
            raise RuntimeError(f"{error}: {self.server.log_tail()}") from None
        except (EOFError, OSError, ValueError, pickle.UnpicklingError):
            self.dead = True
            raise RuntimeError(f"the compile worker stopped: {self.server.log_tail()}") from None
        if status != "ok":
            raise RuntimeError(value)
        return value

    def _answer(self) -> Any:
        """The worker's next message, waited for at most :func:`compile_timeout` seconds; a worker that sends
        none by then (a compiler that hangs, say) is killed and TimeoutError raised, so that optimize() goes
        on without it. Messages alternate with requests, so none is ever half in the read buffer when this
        waits: select() on the pipe sees every byte still to come."""
        limit = compile_timeout()
        readable, _, _ = select.select([self.results], [], [], limit)
        if not readable:
            if self.pid is not None:
                with contextlib.suppress(OSError):
                    os.kill(self.pid, signal.SIGKILL)
            raise TimeoutError(f"the compile worker sent nothing for {limit:g} s ({TIMEOUT_ENV}) and was stopped")
        return pickle.load(self.results)

    def close(self) -> None:
        for pipe in (self.jobs, self.results):
            with contextlib.suppress(OSError):
                pipe.close()


class Workers:
    """Compile workers, started (forked, or importing the kernels) as soon as this is made, so that a caller
    that makes it before other work (optimize() before its graph passes) finds them ready. Use as a
    context manager, or :meth:`close` it."""

    def __init__(self, count: int | None = None) -> None:
        self.count = default_workers() if count is None else count
        compile_timeout()  # a malformed limit is the caller's error now, not a worker's failure later
        self._born = time.monotonic()  # the timeline's zero (CompileReport.timeline)
        self._servers: list[_Server] = []
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._reset()
        env = {
            **os.environ,
            "TRITON_CACHE_DIR": str(knobs.cache.dir),
            "CUDA_VISIBLE_DEVICES": "",
            "FUSER_WORKER_SYS_PATH": json.dumps(sys.path),
        }
        weakref.finalize(self, Workers._stop, self._servers)
        # One process forking the rest; without fork, one interpreter per worker.
        self._start_method = start_method() if self.count > 0 else ""
        sizes = [self.count] if hasattr(os, "fork") else [1] * self.count
        for size in [n for n in sizes if n > 0]:
            try:
                self._servers.append(_Server(env, size, self._start_method))
            except OSError as error:  # no processes to be had: fewer workers (none: compile in-process)
                warnings.warn(f"fuser: could not start compile workers ({error})", RuntimeWarning, stacklevel=2)
                break
        self._workers = [worker for server in self._servers for worker in server.workers]
        if self._workers:
            _warm_key_here()

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop(self._servers)

    @staticmethod
    def _stop(servers: list[_Server]) -> None:
        while servers:
            servers.pop().close()

    def compile(self, variants: Sequence[Variant], progress: CompileProgress | None = None) -> CompileReport:
        """Compile every variant: :meth:`submit` each, then :meth:`finish`."""
        for variant in variants:
            self.submit(variant, progress)
        return self.finish(progress)

    def submit(self, variant: Variant, progress: CompileProgress | None = None) -> None:
        """Queue ``variant``; the first call starts one feeding thread per worker, each handing its worker
        the next queued variant as soon as the last one is compiled."""
        if self._jobs is None:
            self._jobs, self._start = queue.SimpleQueue(), time.monotonic()
            for worker in self._workers:
                self._threads.append(threading.Thread(target=self._drain, args=(worker, progress), daemon=True))
                self._threads[-1].start()
        # Two workers building one launcher at once would both run the C compiler: the first variant builds it.
        key = variant.launcher_key()
        if key in self._launcher_keys:
            variant = replace(variant, launcher=False)
        self._launcher_keys.add(key)
        self._submitted += 1
        self._jobs.put((variant, time.monotonic()))

    def _drain(self, worker: _Worker | None, progress: CompileProgress | None) -> None:
        assert self._jobs is not None
        while True:
            try:
                job = self._jobs.get() if worker is not None else self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is None:  # finish(): no more variants
                return
            variant, submitted = job
            taken = time.monotonic()
            try:
                result = worker.compile(variant) if worker is not None else compile_one(variant)
            except Exception as error:
                if worker is None:  # it raises again at its launch, where Triton reports it
                    continue
                with self._lock:
                    self._failed.append((variant, f"{type(error).__name__}: {error}"))
                if worker.dead:
                    return  # a dead worker takes no more jobs: the others (or this process) do
                continue
            done = time.monotonic()
            ready = worker.ready_at if worker is not None and worker.ready_at is not None else taken
            times = (round(t - self._born, 3) for t in (submitted, max(taken, ready), done))
            with self._lock:
                self._timeline.append((variant.name, *times))
                self._times.append((result.seconds, variant.name))
                self._adopted += result.adopted
                self._launchers += result.launcher
                if variant.cache_hash and result.cache_hash and result.cache_hash != variant.cache_hash:
                    self._mismatched.append((variant, result))
                if progress is not None:
                    progress.step(variant, len(self._times), self._submitted)

    def finish(self, progress: CompileProgress | None = None) -> CompileReport:
        """Wait for every submitted variant, compile here what no worker took or what a worker failed on
        (one warning naming each of those, with the worker's error), and report."""
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
        _wait_key_here()
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join()
        self._drain(None, progress)  # what no worker took (there were none, or they all died)
        failed = self._failed
        if failed:
            named = "; ".join(f"{variant.describe()}: {error}" for variant, error in failed)
            warnings.warn(
                f"fuser: compiling {len(failed)} kernel variant(s) in a worker process failed, compiling them "
                f"in this process instead: {named}",
                RuntimeWarning,
                stacklevel=2,
            )
        for variant, _ in failed:
            with contextlib.suppress(Exception):  # it fails again at its launch, with Triton's own error
                compile_one(variant)
        if self._mismatched:
            named = "; ".join(f"{v.describe()}: {', '.join(r.differs(v)) or '?'}" for v, r in self._mismatched[:3])
            warnings.warn(
                f"fuser: {len(self._mismatched)} kernel variant(s) compiled ahead are filed under another cache key "
                f"than this process's Triton looks up, so they compile again at their launch (the key fields "
                f"that differ follow): {named}",
                RuntimeWarning,
                stacklevel=2,
            )
        longest = max(self._times, default=(0.0, ""))
        ready = [w.ready_at - self._born for w in self._workers if w.ready_at is not None]
        last = max((w for w in self._workers if w.ready_at is not None), key=lambda w: w.ready_at, default=None)
        boot = () if last is None else tuple((step, round(at - self._born, 3)) for step, at in last.boot.items())
        report = CompileReport(
            self._submitted, len(self._workers), time.monotonic() - self._start, len(failed),
            sum(t for t, _ in self._times), longest[0], longest[1], self._adopted, len(self._mismatched),
            self._launchers, round(max(ready, default=0.0), 3), tuple(sorted(self._timeline, key=lambda t: t[3])),
            boot, self._start_method,
        )  # fmt: skip
        self._reset()
        if progress is not None:
            progress.finish(report)
        return report

    def _reset(self) -> None:
        self._jobs: queue.SimpleQueue[Variant | None] | None = None
        self._threads: list[threading.Thread] = []
        self._failed: list[tuple[Variant, str]] = []  # by a worker: compiled again here
        self._times: list[tuple[float, str]] = []
        self._adopted = 0
        self._launchers = 0
        self._launcher_keys: set[tuple[Any, ...]] = set()
        self._timeline: list[tuple[Any, ...]] = []
        self._mismatched: list[tuple[Variant, Compiled]] = []  # filed under another key than the JIT's
        self._submitted = 0
        self._start = time.monotonic()


@dataclass(frozen=True)
class CompileReport:
    """What :meth:`Workers.compile` did: variants, workers, wall seconds, variants compiled in this process
    after a worker failed; the compile seconds summed over the variants (against ``seconds``: how well the
    workers overlapped) and the longest one's (a floor on ``seconds``) with its kernel; the variants whose
    worker adopted this process's source key of their kernel (:func:`adopt_function_key`: Triton 3.6)
    and those filed under another key than this process's JIT looks up all the same (a warning names
    them and the key fields that differ); the C launchers the workers built (:func:`build_launcher`).

    Where the wall seconds went: ``workers_ready_s``, when the last worker that took a variant had imported
    the kernels, and ``timeline``, per variant in the order they were done ``(kernel, submitted, started,
    done)``, seconds since the workers were started (optimize() starts them before its graph passes): a late
    ``submitted`` is the collecting forward, a ``started`` long after it a queue or a worker still starting.
    ``worker_boot``: for the worker ready last, when it reached each step, on the same clock: started as a
    fork of this process (``fork``) or as an interpreter (its first line, then torch, triton and the kernels
    imported), then Triton's key warmed and the workers forked; ``start``, which of the two
    (:func:`start_method`)."""

    variants: int
    workers: int
    seconds: float
    retried_in_process: int = 0
    compile_s_sum: float = 0.0
    longest_s: float = 0.0
    longest_kernel: str = ""
    adopted_function_keys: int = 0
    key_mismatches: int = 0
    launchers_built: int = 0
    workers_ready_s: float = 0.0
    timeline: tuple[tuple[Any, ...], ...] = ()
    worker_boot: tuple[tuple[str, float], ...] = ()
    start: str = ""  # how the workers started: "fork" or "spawn" (start_method)


class CompileProgress(Progress):
    """The compile progress line on stderr (the tuning line's drawing: in place on a terminal)."""

    def __init__(self, stream: Any = None, min_variants: int = 8) -> None:
        super().__init__(stream)
        self.quiet_below = min_variants

    def step(self, variant: Variant, done: int, total: int) -> None:  # type: ignore[override]
        if total < self.quiet_below:
            return
        width = 20
        filled = width * done // max(1, total)
        elapsed = time.perf_counter() - self.start
        bar = "#" * filled + "." * (width - filled)
        text = f"fuser compile: [{bar}] {done}/{total} {variant.name} | {elapsed:.1f} s"
        self._write(text, final=False)

    def finish(self, report: CompileReport) -> None:
        if report.variants < self.quiet_below:
            return
        if self._drawn:
            self.stream.write("\n")
        self.stream.write(
            f"fuser compile: {report.variants} kernel variants on {report.workers} workers in {report.seconds:.1f} s\n"
        )
        self.stream.flush()
        self._drawn = False


def compile_variants(
    variants: Sequence[Variant], *, workers: Workers | int | None = None, progress: bool = True
) -> CompileReport:
    """Compile ``variants`` into Triton's cache with ``workers`` (a running :class:`Workers`, a count, or
    None for :func:`default_workers`); 0 workers compile in this process."""
    reporter = CompileProgress() if progress else None
    if isinstance(workers, Workers):
        return workers.compile(variants, reporter)
    count = default_workers() if workers is None else workers
    with Workers(min(count, len(variants))) as pool:
        return pool.compile(variants, reporter)


# --- the optimize() step ---------------------------------------------------------------------------------


_last_report: CompileReport | None = None


def last_report() -> CompileReport | None:
    """What the latest compile ahead of this process did (None: none ran): for benchmarks and tests."""
    return _last_report


class Ahead:
    """Compiling a model's kernels ahead of its first forward, as optimize() does on CUDA: made before
    the graph passes (the workers start), then :meth:`compile` with the example forward, then
    :meth:`close`. Inactive (``enabled=False``, or ``FUSER_COMPILE_WORKERS=0``) it does nothing."""

    def __init__(self, enabled: bool) -> None:
        count = default_workers() if enabled else 0
        self.workers = Workers(count) if count > 0 else None

    def close(self) -> None:
        if self.workers is not None:
            self.workers.close()
            self.workers = None

    def compile(self, forward: Callable[[], Any]) -> CompileReport | None:
        """Run ``forward`` collecting, the workers compiling each variant as soon as it is found, and wait
        for them. Nothing while tuning (measuring needs each candidate's kernel run, and compiles it as
        it goes). A forward that fails while collecting (it runs on unwritten kernel outputs) is only
        warned about: the real forward then compiles what the workers have not."""
        global _last_report
        if self.workers is None or autotune.tuning_enabled():
            return None
        workers, progress = self.workers, CompileProgress()

        def submit(variant: Variant) -> None:
            # A kernel of the user's script is not importable by a worker: the JIT compiles it at its launch.
            if not variant.kernel.startswith("__main__:"):
                workers.submit(variant, progress)

        try:
            with collecting(on_variant=submit):
                forward()
        except Exception as error:
            warnings.warn(
                f"fuser: the forward that lists the kernels to compile ahead raised {type(error).__name__}: "
                f"{error}; the kernels it did not reach compile at their first launch",
                RuntimeWarning,
                stacklevel=2,
            )
        report = workers.finish(progress)
        _last_report = report if report.variants else None
        return _last_report


# --- the worker ------------------------------------------------------------------------------------------


def _serve(inp: BinaryIO, out: BinaryIO, boot: dict[str, float]) -> None:
    # CLOCK_MONOTONIC: one clock for all processes
    pickle.dump(("ready", time.monotonic(), os.getpid(), boot), out)
    out.flush()
    while True:
        try:
            variant = pickle.load(inp)
        except EOFError:
            return
        try:
            reply: tuple[str, Any] = ("ok", compile_one(variant))
        except Exception as error:
            reply = ("error", f"{type(error).__name__}: {error}")
        pickle.dump(reply, out)
        out.flush()


# A spawned interpreter's first lines, timing its imports (CompileReport.worker_boot): torch, triton, then
# the kernels with this module.
_WORKER_BOOT = (
    "import time; boot = {'interpreter': time.monotonic()}; "
    "import json, os, sys; sys.path[:] = json.loads(os.environ['FUSER_WORKER_SYS_PATH']); "
    "import torch; boot['torch'] = time.monotonic(); "
    "import triton; boot['triton'] = time.monotonic(); "
    "from fuser.kernels.precompile import worker_main; boot['kernels'] = time.monotonic(); "
    "worker_main(boot)"
)


def worker_main(boot: dict[str, float] | None = None) -> None:
    """A spawned worker interpreter (:class:`_Server`): with the kernels imported, :func:`_serve_all` the
    pipe pairs it was passed. ``boot``: when the interpreter reached each step of its imports (reported
    by each worker, :attr:`CompileReport.worker_boot`)."""
    boot = {"interpreter": time.monotonic()} if boot is None else boot
    importlib.import_module("fuser.kernels")  # imported with this module: the kernels, once, before any fork
    _serve_all([tuple(pair) for pair in json.loads(os.environ[PIPES_ENV])], boot)


def _serve_all(pairs: Sequence[tuple[int, ...]], boot: dict[str, float]) -> None:
    """In a worker process with the kernels imported: warm up, fork a worker for each pipe pair but the
    last, serve the last here; each serves variants until its jobs pipe closes."""
    pairs = list(pairs)
    _warm_up()
    boot["warmed"] = time.monotonic()
    *forked, own = pairs
    children = []
    for pair in forked:
        pid = os.fork()
        if pid == 0:
            try:
                _serve_pair(pair, pairs, {**boot, "forked": time.monotonic()})
            finally:
                os._exit(0)
        children.append(pid)
    _serve_pair(own, pairs, {**boot, "forked": time.monotonic()})
    for pid in children:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def _warm_up() -> None:
    """Once, before forking, what each worker's first compile would otherwise do again: Triton's key over
    its own sources and library (``triton_key``, cached; about 0.3 s) and the code generator's imports
    (0.1 s). Plain Python: no compiler thread exists before the fork (nor, spawned, any GPU state)."""
    with contextlib.suppress(ImportError):
        from triton.compiler import code_generator  # noqa: F401
        from triton.runtime.cache import triton_key

        triton_key()


_key_thread: threading.Thread | None = None
_key_lock = threading.Lock()


def _warm_key_here() -> None:
    """Compute Triton's key (``triton_key``, cached) in a thread of this process while optimize() runs its
    graph passes: the collecting forward's first variant needs it for its cache key (:func:`disk_key`),
    and it is about 0.5 s of hashing on the H200 machine that would otherwise wait in line there."""
    global _key_thread
    with _key_lock, contextlib.suppress(ImportError):
        if _key_thread is None:
            from triton.runtime.cache import triton_key

            _key_thread = threading.Thread(target=triton_key, name="fuser-triton-key", daemon=True)
            _key_thread.start()


def _wait_key_here() -> None:
    """Join :func:`_warm_key_here`'s thread: before this process forks (a thread that imports while the
    process forks leaves its import lock held in the child), and before optimize() returns."""
    if _key_thread is not None:
        _key_thread.join()


def _close_all_but(keep: set[int]) -> None:
    """Close every file descriptor of this process but those in ``keep`` (a forked worker's own)."""
    top = os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 65536
    low = 0
    for fd in sorted(keep):
        if fd > low:  # an empty range would close them all (CPython passes high - 1 to close_range)
            os.closerange(low, fd)
        low = fd + 1
    if top > low:
        os.closerange(low, top)


def _serve_pair(pair: tuple[int, ...], pairs: list[tuple[int, ...]], boot: dict[str, float]) -> None:
    """Serve the pipe pair ``pair`` after closing the others: a worker holds only its own pipes, so that
    its death shows the listing process an end of file."""
    for other in pairs:
        if other != pair:
            for fd in other:
                with contextlib.suppress(OSError):
                    os.close(fd)
    jobs, results = pair
    with os.fdopen(jobs, "rb") as inp, os.fdopen(results, "wb") as out:
        _serve(inp, out, boot)
