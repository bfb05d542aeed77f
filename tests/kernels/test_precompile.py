"""Compiling ahead (fuser.kernels.precompile): the variants a launch needs are listed without a GPU, the
workers' compiles land under the key the JIT looks up, a worker's failure falls back to this process, and
layers that differ only in their conv geometry share one compiled variant.

The CPU tests compile for sm_90 with the ptxas bundled in the triton wheel; the JIT's own lookup runs
under a driver that knows only that target, warming up (compile or cache lookup) instead of launching."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import os
import pickle
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import triton
from triton import knobs
from triton.compiler import compiler as triton_compiler
from triton.runtime.jit import JITFunction

from fuser.kernels import (
    Activation,
    Epilogue,
    Precision,
    autotune,
    conv,
    conv2d_act,
    depthwise,
    direct_conv,
    gemm,
    gemm_act,
    launch,
    pack_conv_weight,
    pack_gemm_weight,
    precompile,
    splitk,
)
from fuser.kernels.autotune import TileConfig
from fuser.kernels.epilogue import Residual

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
needs_ptxas = pytest.mark.skipif(not PTXAS.exists(), reason=f"triton's bundled ptxas is not at {PTXAS}")
SM90 = precompile.parse_arch("sm90")
TILE = TileConfig(64, 32, 32, 8, 4, 3)


def forget_compiled() -> None:
    """Empty the JIT's in-memory kernels of fuser's kernels, so the next launch looks Triton's cache up."""
    for module in (conv, gemm, splitk, depthwise, direct_conv):
        for obj in vars(module).values():
            if isinstance(obj, JITFunction):
                obj.device_caches.clear()


@pytest.fixture(params=["fork", "spawn"])
def start(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How the workers of the test start (precompile.start_method): forked from this process, or a fresh
    interpreter that imports the kernels first."""
    if request.param == "fork" and not sys.platform.startswith("linux"):
        pytest.skip("the workers fork only on Linux")
    monkeypatch.setenv(precompile.START_ENV, request.param)
    return request.param


@pytest.fixture
def triton_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """An empty Triton cache for this test (the workers inherit it through the environment)."""
    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    forget_compiled()
    yield cache
    forget_compiled()


def conv_layer(stride: int = 1, padding: int = 1, dilation: int = 1, tile: TileConfig | None = None) -> None:
    """One fused 3x3 conv launch on odd sizes."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, 32, 19, 23, generator=gen).to(memory_format=torch.channels_last)
    w = pack_conv_weight(torch.randn(48, 32, 3, 3, generator=gen), groups=1, precision=Precision("tf32"))
    conv2d_act(x, w, torch.randn(48, generator=gen), stride=stride, padding=padding, dilation=dilation,
               epilogue=Epilogue(Activation.SILU), interpret=True, tile=tile)  # fmt: skip


def gemm_layer() -> None:
    """One fused GEMM launch with a residual, on odd sizes."""
    gen = torch.Generator().manual_seed(3)
    a = torch.randn(37, 96, generator=gen)
    w = pack_gemm_weight(torch.randn(80, 96, generator=gen), precision=Precision("tf32"))
    gemm_act(a, w, torch.randn(80, generator=gen), epilogue=Epilogue(Activation.GELU, residual=Residual.AFTER_ACT),
             residual=torch.randn(37, 80, generator=gen), interpret=True)  # fmt: skip


def collect(*launches: Callable[[], Any]) -> list[precompile.Variant]:
    with precompile.collecting(simulate="sm90") as variants:
        for run in launches:
            run()
    return variants


def record_compiles(patch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """(kernel, found in Triton's cache) for each compile this process does from now on (Triton's listener)."""
    events: list[tuple[str, bool]] = []

    def listener(*, src: Any, cache_hit: bool, **_: Any) -> None:
        events.append((src.name, cache_hit))

    patch.setattr(knobs.compilation, "listener", listener)
    return events


def jit_lookups(monkeypatch: pytest.MonkeyPatch, *launches: Callable[[], Any]) -> list[tuple[str, bool]]:
    """:func:`record_compiles` of the JIT's own compiles for ``launches``, planned as on an sm_90 GPU;
    ``kernel[grid](...)`` warms up (compiles or loads) instead of launching."""
    with monkeypatch.context() as patch, contextlib.ExitStack() as stack:
        warm = lambda self, grid: lambda *a, **k: self.run(*a, grid=grid, warmup=True, **k)
        patch.setattr(JITFunction, "__getitem__", warm)
        events = record_compiles(patch)
        stack.enter_context(precompile.target_only_driver(SM90))
        stack.enter_context(launch.simulating("sm90"))
        for run in launches:
            run()
    forget_compiled()
    return events


class _KeyComputed(Exception):
    """Raised where the JIT, having computed a launch's cache key, would look it up (see :func:`jit_keys`)."""


def jit_keys(monkeypatch: pytest.MonkeyPatch, forward: Callable[[], Any]) -> dict[str, str]:
    """The on-disk cache keys the JIT itself computes (Triton's ``get_cache_key``, from the launch's own
    arguments) for ``forward``'s launches planned as on an sm_90 GPU, each to its kernel's name; every
    launch stops there, so nothing compiles and nothing runs."""
    keys: dict[str, str] = {}
    real = triton_compiler.get_cache_key

    def spy(src: Any, backend: Any, options: Any, env_vars: dict[str, str]) -> str:
        keys[hashlib.sha256(real(src, backend, options, env_vars).encode("utf-8")).hexdigest()] = src.name
        raise _KeyComputed

    def warm(self: JITFunction, grid: Any) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            with contextlib.suppress(_KeyComputed):
                return self.run(*args, grid=grid, warmup=True, **kwargs)

        return run

    with monkeypatch.context() as patch, contextlib.ExitStack() as stack:
        patch.setattr(triton_compiler, "get_cache_key", spy)
        patch.setattr(JITFunction, "__getitem__", warm)
        stack.enter_context(precompile.target_only_driver(SM90))
        stack.enter_context(launch.simulating("sm90"))
        forward()
    forget_compiled()
    return keys


def small_models() -> Callable[[], None]:
    """EfficientNet-B0 and YOLOv8n (fuser.models) on small inputs (odd where the model allows), fused for
    the interpreter: their forward launches every kernel family (implicit GEMM and direct convs,
    depthwise with its unspecialized sizes, GEMMs on tensor descriptors, split-K reductions, the pool
    pyramid)."""
    import fuser
    from fuser import models

    fused = []
    for name, size in (("efficientnet_b0", 47), ("yolov8n", (64, 96))):
        x = models.example_input(name, batch=1, size=size, seed=1)
        fused.append((fuser.optimize(models.build(name), (x,), backend="interpret", cuda_graphs=False), x))

    def forward() -> None:
        with torch.no_grad():
            for model, x in fused:
                model(x)

    return forward


@needs_ptxas
def test_the_listed_cache_key_is_the_one_the_jit_looks_up(monkeypatch: pytest.MonkeyPatch):
    """Each listed variant's ``cache_hash`` (computed by Triton's own functions from the recorded
    signature, constants, attributes and options) is exactly a key the JIT computes for the same forward,
    and every key the JIT computes is listed: nothing recorded is lost or changed on the way."""
    forward = small_models()
    with precompile.collecting(simulate="sm90") as variants:
        forward()
    kernels = {v.name for v in variants}
    assert {"_gemm_act_kernel", "_conv2d_act_kernel", "_depthwise_act_kernel"} <= kernels
    listed = {v.cache_hash: v.name for v in variants}
    assert "" not in listed and len(listed) == len(variants)
    assert jit_keys(monkeypatch, forward) == listed


_FRESH_PROCESS_KEYS = """
import pickle, sys
from triton.runtime.jit import JITFunction
from fuser.kernels import precompile
variants = pickle.load(sys.stdin.buffer)
modules = [m for name, m in list(sys.modules.items()) if name.startswith("fuser.kernels")]
jitted = [f for m in modules for f in vars(m).values() if isinstance(f, JITFunction)]
own, filed = [], []
for variant in variants:
    for f in jitted:  # every source key as if this kernel were the first this process compiles
        f.hash, f.used_global_vals = None, {}
    function = precompile._resolve(variant.kernel)
    own.append(precompile.disk_key(variant, function))
    precompile.adopt_function_key(function, variant.function_key)
    filed.append(precompile.disk_key(variant, function))
pickle.dump((own, filed), sys.stdout.buffer)
"""


@needs_ptxas
def test_a_fresh_process_files_every_variant_under_the_listed_key():
    """What a worker does with the pickled variants, in a fresh interpreter where each kernel is the first
    it compiles: with the listing process's source keys adopted, every key it files under is the listed
    one. Without them, on Triton 3.6, the GEMM's and the implicit-GEMM conv's keys depend on which kernels
    sharing their @jit helpers were hashed before (here, in this process, at least one of them was)."""
    forward = small_models()
    with precompile.collecting(simulate="sm90") as variants:
        forward()
    child = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS_KEYS], input=pickle.dumps(variants), capture_output=True, check=False
    )
    assert child.returncode == 0, child.stderr.decode()[-2000:]
    own, filed = pickle.loads(child.stdout)
    listed = [v.cache_hash for v in variants]
    assert filed == listed
    order_dependent = {v.name for v, key in zip(variants, own, strict=True) if key != v.cache_hash}
    if tuple(int(p) for p in triton.__version__.split(".")[:2]) < (3, 7):
        assert order_dependent and order_dependent <= {"_gemm_act_kernel", "_conv2d_act_kernel"}, order_dependent
    else:
        assert not order_dependent, f"this Triton's source keys depend on the order: {order_dependent}"


@needs_ptxas
def test_a_worker_files_under_the_listing_process_function_key(
    start: str, triton_cache: Path, monkeypatch: pytest.MonkeyPatch
):
    """Where this process's source key of a kernel is not what a fresh process computes (Triton 3.6: it
    depends on which kernels were hashed first), a spawned worker adopts this process's (a forked one has
    it already): the JIT hits."""
    kernel = gemm._gemm_act_kernel
    monkeypatch.setattr(kernel, "hash", "the key this process computed, another order's")
    variants = [v for v in collect(gemm_layer) if v.name == "_gemm_act_kernel"]
    assert variants[0].function_key == kernel.hash
    report = precompile.compile_variants(variants, workers=1, progress=False)
    assert report.adopted_function_keys == (1 if start == "spawn" else 0) and report.key_mismatches == 0
    assert ("_gemm_act_kernel", True) in jit_lookups(monkeypatch, gemm_layer)


@needs_ptxas
def test_a_key_the_jit_will_not_find_is_warned_with_the_differing_fields(
    triton_cache: Path, monkeypatch: pytest.MonkeyPatch
):
    """A worker whose cache-invalidating environment differs files the variant under another key: the
    report counts it and the warning names the variant and the key field that differs."""
    variant = next(v for v in collect(gemm_layer) if v.name == "_gemm_act_kernel")
    monkeypatch.setenv("TRITON_DISABLE_LINE_INFO", "1")
    workers = precompile.Workers(1)  # started with the variable set, which this process then drops
    monkeypatch.delenv("TRITON_DISABLE_LINE_INFO")
    try:
        with pytest.warns(RuntimeWarning, match=r"1 kernel variant\(s\) compiled ahead are filed under another .*"
                          r"_gemm_act_kernel\[.*w4 s\d\].*: env$"):  # fmt: skip
            report = workers.compile([variant])
    finally:
        workers.close()
    assert report.key_mismatches == 1 and report.retried_in_process == 0


def test_collecting_lists_each_variant_once_and_launches_nothing():
    variants = collect(conv_layer, conv_layer, gemm_layer)
    names = [v.name for v in variants]
    assert names.count("_conv2d_act_kernel") == 1  # the same launch twice is one variant
    assert "_gemm_act_kernel" in names
    conv_variant = next(v for v in variants if v.name == "_conv2d_act_kernel")
    assert conv_variant.constexprs()["KH"] == 3 and conv_variant.constexprs()["ACT"] == int(Activation.SILU)
    assert conv_variant.specialized()["C_IN_G"] == "16"  # 32 input channels: Triton's divisibility mark
    assert conv_variant.options["arch"] == "sm90"
    assert "KH=3" in conv_variant.describe() and "C_IN_G:16" in conv_variant.describe()


def test_conv_geometry_does_not_split_the_variant():
    """Stride, padding and dilation are runtime arguments Triton does not specialize: one compile for all."""
    variants = collect(
        lambda: conv_layer(1, 1, 1, TILE), lambda: conv_layer(2, 0, 1, TILE), lambda: conv_layer(1, 2, 2, TILE)
    )
    assert len(variants) == 1, "\n".join(v.describe() for v in variants)
    for name in ("stride_h", "pad_top", "dil_h"):
        assert name not in variants[0].specialized()


def tma_activation_layer(n: int, c_in: int, c_out: int, h: int, w: int) -> Callable[[], None]:
    """A fused 3x3 TF32 conv whose sm_90 default reads its activations through a tensor descriptor."""

    def run() -> None:
        gen = torch.Generator().manual_seed(c_in + h)
        x = torch.randn(n, c_in, h, w, generator=gen).to(memory_format=torch.channels_last)
        weight = pack_conv_weight(torch.randn(c_out, c_in, 3, 3, generator=gen), groups=1, precision=Precision("tf32"))
        conv2d_act(x, weight, torch.randn(c_out, generator=gen), padding=1, epilogue=Epilogue(Activation.SILU),
                   interpret=True)  # fmt: skip

    return run


# Box tiles (conv_boxes.boxes_by_default: 64 channels, stride 1, 64 output columns, 16384 output pixels): the
# activations as a 5-D descriptor. Shifted taps (YOLO's 256->256 @20 at batch 32, the shipped table's pick from
# results/conv-tile-sweep-2026-12-03d.json): a 2-D descriptor over a zero-bordered copy made before the launch.
TMA_ACTIVATION_LAYERS = {
    "box": (tma_activation_layer(4, 64, 40, 64, 66), {"BOX_W": 16}, []),
    "shifted": (
        tma_activation_layer(32, 256, 256, 20, 20),
        {"TAP_SHIFT": True, "BLOCK_M": 128, "BLOCK_N": 256},
        ["_bordered_copy_kernel"],
    ),
}


@needs_ptxas
@pytest.mark.parametrize("kind", TMA_ACTIVATION_LAYERS)
def test_a_tma_activation_layer_is_listed_compiled_ahead_and_found(
    kind: str, triton_cache: Path, monkeypatch: pytest.MonkeyPatch
):
    """The listing plans the launch as the GPU would (its default tile, the activations as a descriptor), with the
    kernels launched before it (shifted taps: the bordered copy); a worker compiles each under the key the JIT then
    looks up, so the first forward compiles nothing."""
    layer, expected, before = TMA_ACTIVATION_LAYERS[kind]
    monkeypatch.setenv(precompile.START_ENV, "fork" if sys.platform.startswith("linux") else "spawn")
    variants = collect(layer)
    assert [v.name for v in variants] == [*before, "_conv2d_act_kernel"]
    assert {name: variants[-1].constexprs()[name] for name in expected} == expected
    report = precompile.compile_variants(variants, workers=1, progress=False)
    assert report.variants == len(variants) and report.retried_in_process == 0 and report.key_mismatches == 0
    assert jit_lookups(monkeypatch, layer) == [(name, True) for name in [*before, "_conv2d_act_kernel"]]


def test_a_plan_the_interpreter_made_is_not_listed():
    """The interpreter plans this signature first (its own tile, one stage); the listing plans afresh,
    as on the GPU (the conv candidates all pipeline over at least two stages)."""
    conv_layer()
    variant = collect(conv_layer)[0]
    assert variant.options["num_stages"] >= 2 and variant.constexprs()["GROUP_M"] != conv.INTERPRET_CONFIG.group_m


@needs_ptxas
def test_workers_fill_the_cache_the_jit_looks_up(start: str, triton_cache: Path, monkeypatch: pytest.MonkeyPatch):
    """Every variant but the first compiled by two workers: the JIT then finds exactly those in the cache
    and compiles only the first (so the test fails both ways: a key mismatch, or a lookup not made)."""
    launches = (conv_layer, lambda: conv_layer(tile=TILE), gemm_layer)
    variants = collect(*launches)
    assert len(variants) >= 3
    report = precompile.compile_variants(variants[1:], workers=2, progress=False)
    assert report.variants == len(variants) - 1 and report.workers == 2 and report.retried_in_process == 0
    assert report.longest_kernel in {v.name for v in variants[1:]} and 0 < report.longest_s <= report.compile_s_sum
    assert report.key_mismatches == 0
    # the timeline: one entry per variant, each submitted, then started once a worker was ready, then done
    assert sorted(name for name, *_ in report.timeline) == sorted(v.name for v in variants[1:])
    assert all(0 <= submitted <= started <= done for _, submitted, started, done in report.timeline)
    assert 0 < report.workers_ready_s <= max(started for _, _, started, _ in report.timeline)
    # the boot steps of the worker ready last, in order, each before it was ready
    steps, times = zip(*report.worker_boot, strict=True)
    started = ("fork",) if start == "fork" else ("interpreter", "torch", "triton", "kernels")
    assert steps == (*started, "warmed", "forked") and report.start == start
    assert times[0] > 0 and list(times) == sorted(times) and times[-1] <= report.workers_ready_s
    assert [done for *_, done in report.timeline] == sorted(done for *_, done in report.timeline)
    events = jit_lookups(monkeypatch, *launches)
    assert events[0] == (variants[0].name, False)
    assert events[1:] == [(v.name, True) for v in variants[1:]]


@needs_ptxas
def test_a_worker_failure_names_the_variant_and_compiles_here(
    start: str, triton_cache: Path, monkeypatch: pytest.MonkeyPatch
):
    """A kernel the workers cannot resolve (its module exists only in this process; a fork has the module,
    whose attribute then fails outside this process) is compiled here, after a warning naming it with
    its constexprs, warps and stages; the JIT then finds it cached."""
    variant = next(v for v in collect(gemm_layer) if v.name == "_gemm_act_kernel")
    module = types.ModuleType("fuser_precompile_test_only")
    here = os.getpid()

    def only_here(name: str) -> Any:
        if name != "kernel" or os.getpid() != here:
            raise AttributeError(f"{name} exists only in the listing process")
        return gemm._gemm_act_kernel

    module.__getattr__ = only_here  # type: ignore[method-assign]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    moved = dataclasses.replace(variant, kernel=f"{module.__name__}:kernel")
    config = f"w{variant.options['num_warps']} s{variant.options['num_stages']}"
    error = "ModuleNotFoundError" if start == "spawn" else "AttributeError: kernel exists only in the listing"
    message = (
        r"compiling 1 kernel variant\(s\) in a worker process failed, compiling them in this process instead: "
        rf"kernel\[.*{config}\].*: RuntimeError: {error}"
    )
    with pytest.warns(RuntimeWarning, match=message):
        report = precompile.compile_variants([moved], workers=1, progress=False)
    assert report.retried_in_process == 1
    events = jit_lookups(monkeypatch, gemm_layer)
    assert ("_gemm_act_kernel", True) in events


@needs_ptxas
def test_a_worker_that_dies_is_named_and_the_others_go_on(
    start: str, triton_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """Workers are forked from one process: one that dies (here: on importing its kernel's module)
    shows as an end of file on its own pipe only. Its variant is compiled here after a warning, it takes
    no more variants, and the other worker compiles the rest."""
    variants = [v for v in collect(gemm_layer, conv_layer) if v.name in {"_gemm_act_kernel", "_conv2d_act_kernel"}]
    gemm_variant = next(v for v in variants if v.name == "_gemm_act_kernel")
    others = [v for v in variants if v is not gemm_variant]
    assert others
    (tmp_path / "fuser_worker_dies.py").write_text(
        "import os\n"
        "if os.environ.get('CUDA_VISIBLE_DEVICES') == '':  # a compile worker: die\n"
        "    os._exit(3)\n"
        "from fuser.kernels.gemm import _gemm_act_kernel as kernel\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))  # the workers start on this sys.path
    dying = dataclasses.replace(gemm_variant, kernel="fuser_worker_dies:kernel")
    with pytest.warns(RuntimeWarning, match=r"kernel\[.*\].*the compile worker stopped"):
        report = precompile.compile_variants([dying, *others], workers=2, progress=False)
    assert report.retried_in_process == 1 and report.workers == 2
    assert sorted(name for name, *_ in report.timeline) == sorted(v.name for v in others)
    events = jit_lookups(monkeypatch, gemm_layer, conv_layer)
    assert all(hit for name, hit in events if name in {"_gemm_act_kernel", "_conv2d_act_kernel"}), events


@needs_ptxas
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the workers fork only on Linux")
def test_a_worker_that_hangs_is_stopped_and_its_variant_compiled_here(
    triton_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A worker that never answers (a compiler that hangs: here, its kernel's module sleeps on import) is
    killed after FUSER_COMPILE_TIMEOUT_S, named in the warning, and its variant compiled here; the other
    worker compiles the rest. Forked workers are ready at once, so a short limit times only the hang (the
    limit applies the same way to a spawned worker's start)."""
    monkeypatch.setenv(precompile.START_ENV, "fork")
    monkeypatch.setenv(precompile.TIMEOUT_ENV, "4")
    variants = [v for v in collect(gemm_layer, conv_layer) if v.name in {"_gemm_act_kernel", "_conv2d_act_kernel"}]
    gemm_variant = next(v for v in variants if v.name == "_gemm_act_kernel")
    others = [v for v in variants if v is not gemm_variant]
    (tmp_path / "fuser_worker_hangs.py").write_text(
        "import os, time\n"
        "if os.environ.get('CUDA_VISIBLE_DEVICES') == '':  # a compile worker: hang\n"
        "    time.sleep(600)\n"
        "from fuser.kernels.gemm import _gemm_act_kernel as kernel\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    hanging = dataclasses.replace(gemm_variant, kernel="fuser_worker_hangs:kernel")
    started = time.monotonic()
    with precompile.Workers(2) as workers:
        for worker in workers._workers:
            worker.wait_ready()
        pids = {worker.pid for worker in workers._workers}
        with pytest.warns(RuntimeWarning, match=r"kernel\[.*\].*sent nothing for 4 s \(FUSER_COMPILE_TIMEOUT_S\)"):
            report = workers.compile([hanging, *others])
        assert time.monotonic() - started < 60
        assert report.retried_in_process == 1
        assert sorted(name for name, *_ in report.timeline) == sorted(v.name for v in others)
        hung = next(worker for worker in workers._workers if worker.dead)
        assert hung.pid in pids
        deadline = time.monotonic() + 10
        while Path(f"/proc/{hung.pid}").exists() and "Z" not in _proc_state(hung.pid):
            assert time.monotonic() < deadline, "the hung worker was not stopped"
            time.sleep(0.1)


def _proc_state(pid: int) -> str:
    """The state letter of /proc/PID/stat ("Z": exited, not yet reaped), or "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return ""


def test_compile_timeout_is_checked(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(precompile.TIMEOUT_ENV, raising=False)
    assert precompile.compile_timeout() == precompile.DEFAULT_TIMEOUT_S
    monkeypatch.setenv(precompile.TIMEOUT_ENV, "2.5")
    assert precompile.compile_timeout() == 2.5
    for bad in ("soon", "0", "-1"):
        monkeypatch.setenv(precompile.TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match="FUSER_COMPILE_TIMEOUT_S must be a number of seconds"):
            precompile.compile_timeout()
    with pytest.raises(ValueError, match="FUSER_COMPILE_TIMEOUT_S"):  # when the workers start, not at a compile
        precompile.Workers(0)


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir() or not hasattr(os, "fork"), reason="reads /proc (Linux)")
def test_workers_are_forked_from_one_process_and_hold_only_their_own_pipes(start: str, tmp_path: Path):
    """N workers cost at most one import: one process (a fork of this one, or an interpreter that imports
    the kernels) forks the others. Each holds only its own two pipes (a worker that held another's would
    hide that one's death from this process) and none of this process's files."""
    with open(tmp_path / "the user's file", "w") as users_file, precompile.Workers(3) as workers:
        for worker in workers._workers:
            worker.wait_ready()
        (server,) = workers._servers
        pids = [worker.pid for worker in workers._workers]
        assert len(set(pids)) == 3 and server.pid in pids
        for pid in pids:
            parent = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            assert parent == (server.pid if pid != server.pid else os.getpid())
        links = {pid: {os.readlink(fd) for fd in Path(f"/proc/{pid}/fd").iterdir()} for pid in pids}
        assert not any(users_file.name in held for held in links.values()), links
        pipes = {pid: {link for link in held if link.startswith("pipe:")} for pid, held in links.items()}
        assert all(len(held) == 2 for held in pipes.values()), pipes
        assert len(set().union(*pipes.values())) == 6, "two workers share a pipe"


def test_workers_warm_tritons_key_in_this_process(monkeypatch: pytest.MonkeyPatch):
    """While the workers start, a thread here computes Triton's key, which the collecting forward's first
    variant needs (its cache key); it is done before the workers fork and before a compile finishes."""
    from triton.runtime.cache import triton_key

    monkeypatch.setattr(precompile, "_key_thread", None)
    triton_key.cache_clear()
    with precompile.Workers(1) as workers:
        assert precompile._key_thread is not None and precompile._key_thread.name == "fuser-triton-key"
        workers.finish()
        assert not precompile._key_thread.is_alive() and triton_key.cache_info().currsize == 1


def test_start_method_setting(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(precompile.START_ENV, raising=False)
    assert precompile.start_method() == ("fork" if sys.platform.startswith("linux") else "spawn")
    monkeypatch.setenv(precompile.START_ENV, "spawn")
    assert precompile.start_method() == "spawn"
    monkeypatch.setenv(precompile.START_ENV, "forkserver")
    with pytest.raises(ValueError, match="FUSER_COMPILE_START must be 'fork' or 'spawn', got 'forkserver'"):
        precompile.start_method()


def test_worker_count_setting(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(precompile.WORKERS_ENV, "3")
    assert precompile.default_workers() == 3
    monkeypatch.setenv(precompile.WORKERS_ENV, "auto")
    assert 1 <= precompile.default_workers() <= precompile.MAX_WORKERS
    monkeypatch.delenv(precompile.WORKERS_ENV)
    assert precompile.default_workers() >= 1, "compiling ahead is on by default"
    monkeypatch.setenv(precompile.WORKERS_ENV, "0")
    assert precompile.default_workers() == 0
    monkeypatch.setenv(precompile.WORKERS_ENV, "many")
    with pytest.raises(ValueError, match="FUSER_COMPILE_WORKERS must be a whole number"):
        precompile.default_workers()


def test_parse_arch_rejects_other_spellings():
    assert precompile.parse_arch("sm100").arch == 100
    with pytest.raises(ValueError, match="arch must be like 'sm90'"):
        precompile.parse_arch("hopper")


@needs_ptxas
def test_ahead_collects_the_forward_and_compiles_it(triton_cache: Path, monkeypatch: pytest.MonkeyPatch):
    """optimize()'s step, on the CPU: the forward's launches (planned as on sm_90) are compiled by the
    workers, so the JIT's lookups of the same launches all hit."""
    monkeypatch.setenv(precompile.WORKERS_ENV, "2")
    launches = (conv_layer, gemm_layer)
    ahead = precompile.Ahead(True)
    try:
        with precompile.target_only_driver(SM90), launch.simulating("sm90"):
            report = ahead.compile(lambda: [run() for run in launches])
    finally:
        ahead.close()
    assert report is not None and report is precompile.last_report()
    assert report.variants >= 2 and report.retried_in_process == 0
    events = jit_lookups(monkeypatch, *launches)
    assert len(events) == report.variants and all(hit for _, hit in events), events


def test_ahead_skips_while_tuning_and_warns_when_the_forward_fails(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(precompile.WORKERS_ENV, "1")
    monkeypatch.setenv("FUSER_AUTOTUNE", "1")
    calls = []

    def failing() -> None:
        calls.append(1)
        raise IndexError("a data-dependent step on unwritten outputs")

    ahead = precompile.Ahead(True)
    try:
        assert ahead.compile(failing) is None and not calls  # not even run: tuning compiles as it measures
        monkeypatch.setenv("FUSER_AUTOTUNE", "0")
        with pytest.warns(RuntimeWarning, match="compile ahead raised IndexError: a data-dependent"):
            assert ahead.compile(failing) is None
        assert calls == [1]
    finally:
        ahead.close()
    assert precompile.Ahead(False).workers is None


@pytest.mark.gpu
def test_optimize_compiles_ahead_so_the_forward_only_loads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """optimize() on CUDA with empty caches: the workers compile every variant (none falls back), every
    compile the example forward and its CUDA graph recording then do in this process finds its kernel in
    Triton's cache, and the result is right."""
    import fuser
    from fuser import models
    from tests.accuracy import reference64, rel_error

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    monkeypatch.setenv(precompile.WORKERS_ENV, "4")
    autotune.set_cache_dir(tmp_path / "tiles")
    forget_compiled()
    events = record_compiles(monkeypatch)
    try:
        model = models.build("resnet26", width=8)
        x = models.example_input("resnet26", batch=3, size=(45, 37), seed=2)
        fused = fuser.optimize(model.cuda(), (x.cuda(),))
        report = precompile.last_report()
        assert report is not None and report.variants >= 3 and report.workers >= 1
        assert report.retried_in_process == 0 and report.key_mismatches == 0
        assert events, "the forward compiled nothing in this process"
        assert [name for name, hit in events if not hit] == [], f"compiled here, not ahead: {events}"
        with torch.no_grad():
            out = fused(x.cuda())
        assert rel_error(out, reference64(model.cpu(), x)) < 1e-2
    finally:
        autotune.set_cache_dir(None)
        forget_compiled()


def test_compile_progress_line():
    """The progress line names the kernel being compiled and ends with the totals; quiet for a few."""
    variant = collect(gemm_layer)[0]

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()
    progress = precompile.CompileProgress(stream, min_variants=2)
    progress.step(variant, 1, 3)
    progress.step(variant, 3, 3)
    progress.finish(precompile.CompileReport(variants=3, workers=2, seconds=1.25))
    text = stream.getvalue()
    assert f"] 1/3 {variant.name}" in text and "[####################] 3/3" in text
    assert text.endswith("fuser compile: 3 kernel variants on 2 workers in 1.2 s\n")
    quiet = io.StringIO()
    precompile.CompileProgress(quiet, min_variants=8).finish(precompile.CompileReport(3, 2, 1.0))
    assert quiet.getvalue() == ""


@needs_ptxas
def test_a_compile_also_builds_the_launcher_where_triton_compiles_one_per_signature(
    triton_cache: Path, monkeypatch: pytest.MonkeyPatch
):
    """On a Triton that generates a C launcher per kernel signature (up to 3.8), a worker builds it with
    the compiled kernel's own source and metadata, so the listing process's first forward finds it; on a
    Triton without per-signature launchers nothing is built."""
    from triton.backends.nvidia import driver as nvidia_driver

    variant = next(v for v in collect(gemm_layer) if v.name == "_gemm_act_kernel")
    built: list[tuple[Any, Any]] = []
    with monkeypatch.context() as patch:
        patch.delattr(nvidia_driver, "make_launcher", raising=False)
        assert not precompile.compile_one(variant).launcher
    with monkeypatch.context() as patch:
        patch.setattr(nvidia_driver, "make_launcher", lambda *args: "", raising=False)
        patch.setattr(nvidia_driver, "CudaLauncher", lambda src, metadata: built.append((src, metadata)))
        result = precompile.compile_one(variant)
    assert result.launcher and len(built) == 1
    src, metadata = built[0]
    assert src.fn is gemm._gemm_act_kernel and dict(src.constants) == dict(variant.constants)
    assert metadata.num_warps == dict(variant.options)["num_warps"]


@needs_ptxas
def test_variants_sharing_a_launcher_build_it_once(triton_cache: Path, monkeypatch: pytest.MonkeyPatch):
    """Two variants of one launcher key (one signature, the same parameters compiled in as constants) ask
    for one C compile, not one each; a variant of another signature builds its own."""
    from triton.backends.nvidia import driver as nvidia_driver

    gemm_variant = next(v for v in collect(gemm_layer) if v.name == "_gemm_act_kernel")
    conv_variant = next(v for v in collect(conv_layer) if v.name == "_conv2d_act_kernel")
    assert gemm_variant.launcher_key() != conv_variant.launcher_key()
    built: list[str] = []
    monkeypatch.setattr(nvidia_driver, "make_launcher", lambda *args: "", raising=False)
    monkeypatch.setattr(nvidia_driver, "CudaLauncher", lambda src, metadata: built.append(src.fn.__name__))
    report = precompile.compile_variants([gemm_variant, gemm_variant, conv_variant], workers=0, progress=False)
    assert sorted(built) == ["_conv2d_act_kernel", "_gemm_act_kernel"]
    assert report.launchers_built == 2 and report.variants == 3
