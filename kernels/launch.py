"""The host scaffold every launcher extends: input checks with clear errors, the plan cache, the tile
choice (forced, interpreter default or measured), the compiled/interpreted launch switch, and the
choice between the tensor-descriptor (TMA) path and the pointer path.

A kernel file adds its ``@triton.jit`` kernel, its candidate list and a ``prepare_*`` that turns checked
example inputs into ``run(...)``: it builds a :class:`KernelCall` (the kernel with the call's scalars and
constexprs), a ``runner(config)`` and hands both to :func:`choose_tile`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from triton import knobs
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

from fuser.activations import spec

from . import autotune
from .autotune import TileConfig
from .epilogue import Activation, Epilogue, Residual
from .interpret import run_interpreted
from .precision import Precision
from .tile_heuristic import SM_COUNT

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def cdiv(a: int, b: int) -> int:
    """Ceiling division (``triton.cdiv`` is a constexpr function in newer triton, slow on the host)."""
    return -(-a // b)


def alignment_unit(element_size: int, values: Sequence[int]) -> int:
    """The largest element count ``v`` (a power of two, at most 16 bytes' worth) dividing every one of
    ``values``: a kernel that receives sizes and strides as multiples of a constexpr ``v`` can vectorize
    loads and stores of channel runs that Triton's own specialization (integers divisible by 16) misses."""
    vec = max(1, 16 // element_size)
    while vec > 1 and any(int(v) % vec for v in values):
        vec //= 2
    return vec


def check_device(op: str, interpret: bool, tensors: dict[str, torch.Tensor | None]) -> torch.device:
    """All tensors on one device, CPU under ``interpret=True`` and CUDA otherwise; returns it."""
    device: torch.device | None = None
    for name, t in tensors.items():
        if t is None:
            continue
        if interpret and t.device.type != "cpu":
            raise ValueError(f"{op}: interpret=True runs on the CPU, but {name} is on {t.device}")
        if not interpret and t.device.type != "cuda":
            raise ValueError(
                f"{op}: compiled Triton kernels need CUDA tensors, but {name} is on {t.device} "
                "(use interpret=True for CPU tensors)"
            )
        if device is None:
            device = t.device
        elif t.device != device:
            raise ValueError(f"{op}: {name} is on {t.device}, other inputs on {device}")
    assert device is not None
    return device


def check_float(op: str, name: str, t: torch.Tensor) -> None:
    if t.dtype not in FLOAT_DTYPES:
        raise ValueError(f"{op}: {name} must be float32, float16 or bfloat16, got {t.dtype}")


def check_bias(op: str, bias: torch.Tensor | None, channels: int) -> torch.Tensor | None:
    """The bias as a contiguous float32 vector (the epilogue adds it in float32)."""
    if bias is None:
        return None
    if bias.dim() != 1 or bias.shape[0] != channels:
        raise ValueError(f"{op}: bias must have shape ({channels},), got {tuple(bias.shape)}")
    if not bias.is_floating_point():
        raise ValueError(f"{op}: bias must be floating point, got {bias.dtype}")
    return bias.to(torch.float32).contiguous()


def check_residual(
    op: str, epilogue: Epilogue, residual: torch.Tensor | None, out_shape: Sequence[int]
) -> torch.Tensor | None:
    """The residual expanded (stride 0 where broadcast) to the output's logical shape."""
    if (residual is None) != (epilogue.residual == Residual.NONE):
        raise ValueError(
            f"{op}: epilogue {epilogue.describe()!r} "
            + ("needs a residual tensor" if residual is None else "has no residual step, but got a residual")
        )
    if residual is None:
        return None
    if not residual.is_floating_point():
        raise ValueError(f"{op}: residual must be floating point, got {residual.dtype}")
    try:
        return residual.expand(*out_shape)
    except RuntimeError:
        raise ValueError(
            f"{op}: residual of shape {tuple(residual.shape)} does not broadcast to the output shape {tuple(out_shape)}"
        ) from None


def check_input_scale(
    op: str, scale: torch.Tensor | None, batch: int, channels: int, dtype: torch.dtype, what: str = "x"
) -> torch.Tensor | None:
    """The channel-scale prologue's factors as a ``[batch, channels]`` view (stride 0 where broadcast), from
    ``scale`` of shape ``[batch or 1, channels, 1, 1]`` (a conv's) or ``[batch or 1, channels]`` (a GEMM's)
    in ``what``'s dtype; None for None."""
    if scale is None:
        return None
    shape = tuple(scale.shape)
    ok = scale.dim() in (2, 4) and shape[0] in (1, batch) and shape[1] == channels and all(d == 1 for d in shape[2:])
    if not ok:
        expected = f"[{batch} or 1, {channels}" + (", 1, 1]" if scale.dim() == 4 else "]")
        raise ValueError(
            f"{op}: input_scale must have shape {expected} (one factor per image and channel), got {shape}"
        )
    if scale.dtype != dtype:
        raise ValueError(f"{op}: input_scale is {scale.dtype} but {what} is {dtype}; they must match")
    return scale.as_strided((batch, channels), (scale.stride(0) if shape[0] > 1 else 0, scale.stride(1)))


def check_input_affine(
    op: str, affine: torch.Tensor | None, act: int, batch: int, channels: int, device: torch.device
) -> torch.Tensor | None:
    """The affine prologue's pairs (tiles.py) as the ``[batch, channels]`` view of their scales that the
    kernels read (stride 0 over the batch, 2 over the channels: each shift follows its scale), from
    ``affine`` of shape ``[channels, 2]`` (columns scale, shift; float32, contiguous) for activation
    ``act``, which must take no parameter; None for None."""
    if affine is None:
        return None
    if not isinstance(affine, torch.Tensor) or tuple(affine.shape) != (channels, 2):
        shape = tuple(affine.shape) if isinstance(affine, torch.Tensor) else type(affine).__name__
        raise ValueError(
            f"{op}: input_affine must have shape [{channels}, 2] (scale and shift per channel), got {shape}"
        )
    if affine.dtype != torch.float32 or not affine.is_contiguous():
        raise ValueError(f"{op}: input_affine must be a contiguous float32 tensor, got {affine.dtype}")
    if affine.device != device:
        raise ValueError(f"{op}: input_affine is on {affine.device} but x is on {device}")
    if act not in {int(a) for a in Activation} or spec(act).alpha_arg is not None:
        raise ValueError(f"{op}: input_act must be an activation without a parameter, got {act!r}")
    return affine.as_strided((batch, channels), (0, 2))


def dot_precision(precision: Precision, operand: torch.dtype) -> str:
    """``input_precision`` for ``tl.dot``: the policy's for float32 operands; 16-bit ones ignore it."""
    return precision.dot_precision if operand == torch.float32 else "tf32"


@functools.cache
def _descriptors_on(device_index: int) -> bool:
    try:
        from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def descriptors_available(device: torch.device) -> bool:
    """Whether host-side tensor descriptors (TMA, Hopper and later) can be used on ``device``.

    The interpreter understands them too, so CPU tests cover the descriptor path's indexing.
    """
    if device.type == "cpu":
        try:
            from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: F401
        except ImportError:
            return False
        return True
    return _descriptors_on(device.index if device.index is not None else torch.cuda.current_device())


def aligned_2d(t: torch.Tensor) -> bool:
    """A 2-D tensor a descriptor can address: unit inner stride, 16-byte aligned base and row stride."""
    size = t.element_size()
    return (
        t.dim() == 2
        and t.stride(1) == 1
        and (t.stride(0) * size) % 16 == 0
        and t.data_ptr() % 16 == 0
        and t.shape[0] > 0
        and t.shape[1] > 0
    )


def _descriptor_defaults() -> dict[str, Any]:
    import dataclasses

    from triton.tools.tensor_descriptor import TensorDescriptor

    return {f.name: f.default for f in dataclasses.fields(TensorDescriptor) if f.default is not dataclasses.MISSING}


_DESCRIPTOR_DEFAULTS: dict[str, Any] | None = None


def make_descriptor(t: torch.Tensor, block_shape: Sequence[int]) -> Any:
    """A host-side tensor descriptor of ``t`` (whose alignment the caller checked: :func:`aligned_2d`, or
    conv_boxes.box_geometry for the implicit GEMM's 5-D activation view).

    Built without the dataclass's own validation: it repeats our alignment checks and costs more
    than the rest of the launch on small problems, where the launcher's CPU time is the runtime.
    """
    global _DESCRIPTOR_DEFAULTS
    from triton.tools.tensor_descriptor import TensorDescriptor

    if _DESCRIPTOR_DEFAULTS is None:
        _DESCRIPTOR_DEFAULTS = _descriptor_defaults()
    desc = object.__new__(TensorDescriptor)
    fields = desc.__dict__
    fields.update(_DESCRIPTOR_DEFAULTS)
    fields.update(base=t, shape=list(t.shape), strides=list(t.stride()), block_shape=block_shape)
    return desc


def tensor_meta(t: torch.Tensor | None) -> tuple[Any, ...] | None:
    """What a launch plan depends on in an input tensor (not its values)."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16 == 0)


def check_path(op: str, path: str) -> None:
    if path not in ("auto", "descriptor", "pointer"):
        raise ValueError(f"{op}: path must be 'auto', 'descriptor' or 'pointer', got {path!r}")


class LaunchOptions:
    """One launch plan's keyword arguments (constexprs, warps, stages), and after its first compiled launch
    the compiled kernel, which later launches of the plan call directly.

    ``JITFunction.run`` binds and specializes every argument and hashes a cache key on each call: tens of
    microseconds of host time, more than a small layer takes on the GPU. A plan's calls all have the same
    specialization (its key pins shapes, strides, dtypes and 16-byte alignment, and every scalar argument
    is a constant of the plan), so the kernel compiled for the first call is the kernel of every call, and
    the launch can skip straight to what ``JITFunction.run`` ends with: ``compiled.run(...)`` with the
    bound arguments in parameter order and the same launch hooks. Set :data:`DIRECT_LAUNCH` to False to
    go through ``JITFunction.run`` every time.
    """

    __slots__ = ("_compiled", "_constexpr_tail", "_device", "kwargs")

    def __init__(self, kwargs: dict[str, Any]) -> None:
        self.kwargs = kwargs
        self._compiled: Any = None
        self._device: int | None = None
        self._constexpr_tail: tuple[Any, ...] = ()

    def launch(self, kernel: JITFunction, grid: tuple[int, ...], args: Sequence[Any]) -> Any:
        compiled = self._compiled
        if compiled is not None and DIRECT_LAUNCH:
            device = driver.active.get_current_device()
            if device == self._device:
                stream = driver.active.get_current_stream(device)
                bound = (*args, *self._constexpr_tail)
                metadata = compiled.launch_metadata(grid, stream, *bound)
                compiled.run(
                    grid[0],
                    grid[1] if len(grid) > 1 else 1,
                    grid[2] if len(grid) > 2 else 1,
                    stream,
                    compiled.function,
                    compiled.packed_metadata,
                    metadata,
                    knobs.runtime.launch_enter_hook,
                    knobs.runtime.launch_exit_hook,
                    *bound,
                )
                return compiled
        compiled = kernel[grid](*args, **self.kwargs)
        self._remember(kernel, compiled, len(args))
        return compiled

    def _remember(self, kernel: JITFunction, compiled: Any, positional: int) -> None:
        """Keep ``compiled`` for direct launches when every parameter after the positional arguments is a
        constexpr this plan passes (or that has a default); otherwise keep using ``JITFunction.run``."""
        tail = []
        for param in kernel.params[positional:]:
            if param.name in self.kwargs:
                tail.append(self.kwargs[param.name])
            elif getattr(param, "default", inspect.Parameter.empty) is not inspect.Parameter.empty:
                tail.append(param.default)
            else:
                return
        if not all(hasattr(compiled, name) for name in ("run", "function", "packed_metadata", "launch_metadata")):
            return
        self._constexpr_tail = tuple(tail)
        self._device = driver.active.get_current_device()
        self._compiled = compiled


DIRECT_LAUNCH = True


def launch_options(kernel: JITFunction, constexprs: dict[str, Any], config: TileConfig) -> LaunchOptions:
    """Options of one plan's launches: the kernel's constexprs, its tile constexprs, warps and stages."""
    tile = {name: value for name, value in config.constexprs().items() if name in kernel.arg_names}
    if "SPLIT_K" in kernel.arg_names and "SPLIT_K" not in constexprs:  # the reduction sets its own
        tile["SPLIT_K"] = config.split_k
    return LaunchOptions({**constexprs, **tile, "num_warps": config.num_warps, "num_stages": config.num_stages})


class SimulatedGPU:
    """What an interpreter run pretends to be under :func:`simulating`: the GPU architecture whose tile
    defaults the plans take (``arch`` as in "sm90") and its SM count."""

    __slots__ = ("arch", "sm_count")

    def __init__(self, arch: str, sm_count: int) -> None:
        self.arch, self.sm_count = arch, sm_count


# Constexprs that only the interpreter sets (its tl.dot needs them); a simulated compiled launch drops them.
INTERPRETER_ONLY = {"UPCAST": False}
_simulated: SimulatedGPU | None = None


@contextlib.contextmanager
def simulating(arch: str = "sm90", sm_count: int = SM_COUNT) -> Iterator[SimulatedGPU]:
    """Within: launchers given CPU tensors with ``interpret=True`` plan as they would on a CUDA GPU of
    ``arch`` (the shipped table's or the cost model's tile, never the interpreter's; no tuning) and hand
    their launches to the Triton JIT instead of the interpreter, with the interpreter-only constexprs
    switched off: what fuser.kernels.precompile uses to list a model's compiled variants without a GPU.
    The JIT needs a driver for that target and a hook that stops it compiling
    (:func:`fuser.kernels.precompile.collecting` sets both)."""
    global _simulated
    outer, _simulated = _simulated, SimulatedGPU(arch, sm_count)
    try:
        yield _simulated
    finally:
        _simulated = outer


def launch(
    kernel: JITFunction,
    grid: tuple[int, ...],
    args: Sequence[Any],
    options: LaunchOptions,
    interpret: bool,
) -> Any:
    """Launch compiled (returns Triton's compiled kernel, whose ``asm`` holds the PTX), or run the same
    kernel in the interpreter (returns None; it ignores ``num_warps`` / ``num_stages``)."""
    if interpret and _simulated is not None:
        kwargs = {**options.kwargs, **{k: v for k, v in INTERPRETER_ONLY.items() if k in options.kwargs}}
        return kernel[grid](*args, **kwargs)
    if interpret:
        run_interpreted(kernel, grid, *args, **options.kwargs)
        return None
    return options.launch(kernel, grid, args)


class KernelCall:
    """One kernel's launches for one call signature: the JIT function, the call's trailing scalar
    arguments (sizes, strides, epilogue scalars: constants of the signature) and its constexprs."""

    __slots__ = ("constexprs", "interpret", "kernel", "scalars")

    def __init__(
        self, kernel: JITFunction, scalars: Sequence[Any], constexprs: dict[str, Any], interpret: bool
    ) -> None:
        self.kernel, self.scalars, self.constexprs, self.interpret = kernel, tuple(scalars), constexprs, interpret

    def options(self, config: TileConfig, **constexprs: Any) -> LaunchOptions:
        """The launch options of ``config``, with ``constexprs`` that depend on it (split-K's reduction)."""
        return launch_options(self.kernel, {**self.constexprs, **constexprs}, config)

    def launch(self, grid: tuple[int, ...], pointers: Sequence[Any], options: LaunchOptions) -> Any:
        """Launch with ``pointers`` (tensors or descriptors) followed by the signature's scalars."""
        return launch(self.kernel, grid, (*pointers, *self.scalars), options, self.interpret)


def choose_tile(
    name: str,
    key: dict[str, Any],
    candidates: Sequence[TileConfig],
    bench_call: Callable[[TileConfig], Any],
    *,
    interpret: bool,
    interpret_config: TileConfig,
    forced: TileConfig | None,
    device: torch.device,
    problem: autotune.Problem | None = None,
) -> TileConfig:
    """The tile of a plan: ``forced`` when given (tests, and tools that sweep every candidate); under the
    interpreter ``interpret_config`` (large tiles, few programs: the interpreter's cost is per program),
    unless :func:`simulating` a GPU, whose default it then takes;
    else :func:`autotune.choose` among ``candidates``, timing ``bench_call(config)`` on the example
    tensors (only while tuning: otherwise the default comes from the shipped table or the cost model for
    ``problem``). ``key`` describes the launch; :func:`autotune.choose` adds the GPU and triton version."""
    if forced is not None:
        return forced
    if interpret and _simulated is not None:
        return autotune.default_config(name, candidates, problem, _simulated.arch, _simulated.sm_count)
    if interpret:
        return interpret_config
    return autotune.choose(
        name, key, candidates, lambda c: autotune.do_bench_ms(lambda: bench_call(c)), device=device, problem=problem
    )


class PlanCache:
    """Launch plans by call signature: a launcher's checks, kernel and tile choice run on the first call of
    a signature; later calls look the plan up by a tuple and only allocate and launch (on small problems
    the launcher's CPU time is the runtime). Emptied with the tile choices (:func:`autotune.set_cache_dir`)."""

    def __init__(self) -> None:
        self._plans: dict[tuple[Any, ...], Callable[..., Any]] = {}
        autotune.register_plan_cache(self._plans)

    def get(self, key: Callable[[], tuple[Any, ...]], build: Callable[[], Callable[..., Any]]) -> Callable[..., Any]:
        """The plan under ``key()``, built by ``build()`` if new. A key that cannot be made (arguments that
        are not tensors, unhashable values) builds without caching, so the checks in ``build`` report it;
        so does every call while :func:`simulating` (its plans are not the interpreter's)."""
        if _simulated is not None:
            return build()
        try:
            signature: tuple[Any, ...] | None = key()
            plan = self._plans.get(signature)  # type: ignore[arg-type]
        except (AttributeError, TypeError):
            signature, plan = None, None
        if plan is None:
            plan = build()
            if signature is not None:
                self._plans[signature] = plan
        return plan


def check_out(
    op: str, out: torch.Tensor, shape: Sequence[int], dtype: torch.dtype, device: torch.device, channel_dim: int
) -> torch.Tensor:
    """A caller's preallocated output as the kernels' rows view ``[rows, channels]`` (unit channel stride,
    one row stride, which may exceed the channel count: a channel slice of a wider buffer).

    ``shape`` is the logical output shape and ``channel_dim`` its channel dimension (1 for a conv's NCHW
    logical shape, the last for a GEMM); the other dimensions, in NHWC / row-major order, must be
    addressable as rows of one stride.
    """
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != tuple(shape):
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(f"{op}: out must have the output's shape {tuple(shape)}, got {got}")
    if out.dtype != dtype or out.device != device:
        raise ValueError(f"{op}: out must be {dtype} on {device} like the output, got {out.dtype} on {out.device}")
    channels = shape[channel_dim]
    row_dims = [d for d in range(len(shape)) if d != channel_dim]
    # The row stride is that of the innermost row dimension with more than one entry (size-1 dims have
    # arbitrary strides); a single row can have any.
    row_stride = next((out.stride(d) for d in reversed(row_dims) if shape[d] > 1), channels)
    expected, ok = row_stride, out.stride(channel_dim) == 1 or channels == 1
    for d in reversed(row_dims):
        ok = ok and (shape[d] == 1 or out.stride(d) == expected)
        expected *= shape[d]
    if not ok or row_stride < channels:
        raise ValueError(
            f"{op}: out (strides {out.stride()}) must hold channels contiguously and its pixels as rows of one "
            f"stride >= {channels} (a channels_last tensor, or a channel slice of one)"
        )
    rows = 1
    for d in row_dims:
        rows *= shape[d]
    return out.as_strided((rows, channels), (row_stride, 1))


def with_fallback(
    runner: Callable[[TileConfig], Callable[..., Any]],
    config: TileConfig,
    candidates: Sequence[TileConfig],
    forced: bool,
) -> Callable[..., Any]:
    """``runner(config)``, unless a launch of it runs out of shared memory or registers: then, from that call
    on, the plan of the first of the other ``candidates`` whose launch fits.

    The default tile comes from a table measured on the kernel's other variants: one with an operand
    prologue keeps more of the A tile on chip (an fp16 3x3 conv with a BatchNorm prologue asked for 292 KiB
    of shared memory with a table entry measured without one). Triton refuses such a launch before it runs,
    so nothing was written and the next candidate can take the same call. (Not only the first call: the
    compile-ahead listing forward records launches without making them.) A forced tile fails as asked."""
    from triton.runtime.errors import OutOfResources

    current = [runner(config)]
    if forced:
        return current[0]
    rest = iter([c for c in candidates if c != config])

    def run(*args: Any, **kwargs: Any) -> Any:
        while True:
            try:
                return current[0](*args, **kwargs)
            except OutOfResources:
                candidate = next(rest, None)
                if candidate is None:
                    raise
                current[0] = runner(candidate)

    return run


class Float32Copies:
    """Float32 copies of the biases the plans are called with, made once per tensor and version instead of
    once per call (:data:`FLOAT32_BIASES`, shared by every plan).

    A model cast to fp16 holds fp16 biases while the epilogue adds in float32: converting on every call was
    one copy kernel per fused layer per forward (53 launches, 0.11 ms of ResNet-50's forward at batch 32 on
    the H200). A plan is shared by every layer of its call signature, so copies are kept per bias tensor
    (by ``id``, checked through a weak reference, dropped when the bias is freed). An in-place edit bumps the
    tensor's version and is converted again; the older copy is kept, since a CUDA graph recorded before the
    edit may still read it."""

    __slots__ = ("_copies",)

    def __init__(self) -> None:
        self._copies: dict[int, tuple[Any, int, list[torch.Tensor]]] = {}

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        key = id(t)
        hit = self._copies.get(key)
        if hit is not None and hit[0]() is t and hit[1] == t._version:
            return hit[2][-1]
        copy = t.float().contiguous()
        kept = hit[2] + [copy] if hit is not None and hit[0]() is t else [copy]
        forget = lambda _ref, key=key, copies=self._copies: copies.pop(key, None)
        self._copies[key] = (weakref.ref(t, forget), t._version, kept)
        return copy


# One table for every plan of the process. Per plan, a bias met first by a plan that a compiled forward
# (torch.compile mode="reduce-overhead") builds got its copy allocated in that forward's CUDA-graph pool and
# kept: "tensors in the cudagraph pool not tracked as outputs". Shared, the copy made by the module (outside
# any pool, fuser.lower.fused_modules) or by its eager calls serves every later plan of the same bias.
FLOAT32_BIASES = Float32Copies()
