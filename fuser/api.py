"""The public entry points: ``optimize`` and ``explain``.

    nn.Module | ONNX --capture--> fx graphs --canonicalize--> --match--> --rewrite--> nn.Module

Both work on a copy of the model (unless ``inplace=True``), so the user's module and parameters are never
changed; ``explain`` stops after matching and returns the report of what ``optimize`` would do.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from fuser.canonicalize import canonicalize
from fuser.capture.specialize import ShapeGuard, cpu_copy, prefer_specialized
from fuser.capture.tracing import Capture, CapturedGraph, UntracedModule, capture, install, propagate_shapes
from fuser.graph_ops import bind, constant_tensor
from fuser.kernels import autotune, precompile
from fuser.kernels.precision import Precision
from fuser.lower import ops
from fuser.match.chain import Chain
from fuser.match.matcher import find_chains
from fuser.match.patterns import FUSED_LINEAR
from fuser.report import ChainReport, FusionReport, settle_batch_norms, settle_kernels
from fuser.rewrite.batchnorm_prologue import fold_batch_norms_forward
from fuser.rewrite.cat_buffers import eliminate_cats
from fuser.rewrite.chains import rewrite_chains
from fuser.rewrite.channel_mean import fuse_channel_means
from fuser.rewrite.depthwise_pool import fuse_depthwise_pools
from fuser.rewrite.detect_head import find_detect_heads, install_detect_heads
from fuser.rewrite.input_scale import fold_input_scales
from fuser.rewrite.max_pool import fuse_max_pools
from fuser.rewrite.pool_pyramid import fuse_pool_pyramids
from fuser.rewrite.tf32_rounding import compensate_truncated_inputs, mark_tf32_rounded_outputs
from fuser.rewrite.virtual_cat import fuse_virtual_cats
from fuser.rewrite.zero_pad import fold_zero_pads
from fuser.runtime.cuda_graphs import GraphReplay
from fuser.runtime.torch_precision import torch_precision

ModelLike = nn.Module | str | os.PathLike


class OptimizedModule(nn.Module):
    """The optimized model: ``module`` runs under the precision policy; ``fusion_report`` says what was fused.

    With ``tune=True`` a call with input shapes not seen before measures the tile configs of its new
    launch signatures (fuser.kernels.autotune); otherwise they take the default, measuring nothing."""

    tune = False  # modules saved before the attribute existed load untuned

    def __init__(
        self,
        module: nn.Module,
        fusion_report: FusionReport,
        precision: Precision,
        backend: str,
        cuda_graphs: bool = True,
        tune: bool = False,
    ) -> None:
        super().__init__()
        self.module = module
        self.fusion_report = fusion_report
        self.precision = precision
        self.backend = backend
        self.replay = GraphReplay(module) if cuda_graphs else None
        self.tune = _check_tune(tune)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # the compiler traces the model itself, and records its own graphs
            return self.module(*args, **kwargs)
        if self.tune:
            with autotune.tuning(drop_defaults=False):
                return self._forward(*args, **kwargs)
        return self._forward(*args, **kwargs)

    def _forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch_precision(self.precision), _on_device_of(args):
            if self.replay is not None and not kwargs:
                return self.replay(*args)
            return self.module(*args, **kwargs)

    def _apply(self, fn: Any, recurse: bool = True) -> nn.Module:
        if self.replay is not None:
            self.replay.clear()  # a recorded graph replays the addresses of the tensors it was recorded with
        return super()._apply(_once_per_tensor(fn), recurse)

    def extra_repr(self) -> str:
        return f"fused={len(self.fusion_report.fused)}, precision={self.precision.value}, backend={self.backend}"


def _once_per_tensor(fn: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``fn`` (what ``.to()``, ``.cuda()``, ``.half()`` apply to each tensor) called once per piece of memory: a
    folded weight that several fused modules hold (a block applied at several places; each module's buffer is
    its own view of it) stays one tensor after the move, where nn.Module would copy it once per module."""
    done: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = {}  # the tensor kept: its memory stays

    def once(t: torch.Tensor) -> torch.Tensor:
        try:
            storage = t.untyped_storage().data_ptr() if t.layout == torch.strided and not t.is_meta else None
        except (RuntimeError, NotImplementedError):  # a tensor subclass without plain storage
            storage = None
        if storage is None:
            return fn(t)
        key = (type(t), storage, t.storage_offset(), t.shape, t.stride(), t.dtype, t.device, t.requires_grad)
        if key not in done:
            done[key] = (t, fn(t))
        return done[key][1]

    return once


def _on_device_of(args: tuple[Any, ...]) -> contextlib.AbstractContextManager:
    """The first CUDA input's device made current for the forward: Triton launches on the current device,
    and a model moved to ``cuda:1`` must run there when ``cuda:0`` is current."""
    for t in args:
        if isinstance(t, torch.Tensor) and t.is_cuda:
            return (
                contextlib.nullcontext()
                if t.device.index == torch.cuda.current_device()
                else torch.cuda.device(t.device)
            )
    return contextlib.nullcontext()


def optimize(
    model: ModelLike,
    example_inputs: Any = None,
    *,
    precision: str = "tf32",
    backend: str = "auto",
    inplace: bool = False,
    cuda_graphs: bool = True,
    tune: bool = False,
) -> OptimizedModule:
    """Return a module that computes the same function as ``model`` with its chains fused.

    Args:
        model: an ``nn.Module``, or an ONNX model (a path to an .onnx file, or an ``onnx.ModelProto``).
        example_inputs: a tensor or a tuple of the model's positional inputs. Optional; with them the model is
            run once (an input it rejects is an error here, not later), shapes and dtypes are checked, and on
            a GPU the kernels are compiled and tuned for these shapes before this returns.
        precision: "tf32" (default), "tf32x3", "ieee", "bf16" or "fp16": how the fused kernels do their dots
            (fuser.kernels.precision explains each); the unfused ops run under matching torch flags.
        backend: "auto" (compiled Triton kernels on CUDA inputs, the torch reference on CPU inputs), "triton",
            "measured" (CUDA: per layer the faster of the Triton kernel and cuDNN/cuBLAS on the folded weights,
            measured on the first call), "interpret" (the same kernels in Triton's interpreter, on CPU) or
            "torch" (the reference).
        inplace: allow ``model`` itself to be used and changed instead of a copy (saves the memory of a copy).
        cuda_graphs: on CUDA inputs under ``torch.no_grad()`` / ``torch.inference_mode()``, record the forward
            as a CUDA graph once per input signature (at most 4 kept, each with its own memory) and replay it
            (fuser.runtime.cuda_graphs): one launch instead of one per kernel, which is what wins at batch 1. A forward
            that cannot be recorded runs with plain launches after one warning. Off under torch.compile,
            which records its own (mode="reduce-overhead"); ``False`` switches it off.
        tune: measure the tile configurations of every kernel launch instead of taking the default (the
            table of choices measured for the GPU's architecture, else a cost model), with a progress line
            on stderr; the choices are cached on disk (fuser.kernels.autotune), so a later ``optimize``
            of the same shapes on this GPU reads them without measuring. Off by default: a tuning run
            compiles and times every candidate (about a minute per model on an H200). It also applies
            to later calls of the module with new input shapes. ``FUSER_AUTOTUNE=1`` / ``0`` overrides it.

    The result carries ``.fusion_report``. Chains that fail a guard stay unfused and are listed, with the reason,
    in ``.fusion_report.rejected``.
    """
    policy = Precision.parse(precision)
    ops.check_backend(backend)
    _check_tune(tune)
    inputs = _as_inputs(example_inputs)
    if inputs is not None:
        for t in inputs:
            if isinstance(t, torch.Tensor):
                ops.resolve_backend(backend, t.device)  # a backend that cannot run where the inputs are: say so now
    # On CUDA the kernels compile ahead in worker processes (fuser.kernels.precompile; FUSER_COMPILE_WORKERS=0
    # turns it off), which start now, so that they are ready when the passes are done.
    ahead = precompile.Ahead(inputs is not None and _on_cuda(inputs) and backend in ("auto", "triton") and not tune)
    working = _working_copy(model, inplace)
    root, report = _run_pipeline(working, inputs, policy, backend)
    optimized = OptimizedModule(root, report, policy, backend, cuda_graphs, tune)
    if inputs is not None and _on_cuda(inputs) and backend in ("auto", "triton", "measured"):
        with torch.no_grad(), autotune.tuning() if tune else contextlib.nullcontext():
            ahead.compile(lambda: _forward_uncaptured(optimized, inputs))
            optimized(*inputs)  # compiles the kernels (and with tune=True measures their tile configs)
    ahead.close()
    return optimized


def _forward_uncaptured(optimized: OptimizedModule, inputs: tuple[Any, ...]) -> Any:
    with torch_precision(optimized.precision), _on_device_of(inputs):
        return optimized.module(*inputs)


def _check_tune(tune: Any) -> bool:
    if not isinstance(tune, bool):
        raise TypeError(f"tune must be True or False, got {tune!r}")
    return tune


def explain(
    model: ModelLike, example_inputs: Any = None, *, precision: str = "tf32", backend: str = "auto"
) -> FusionReport:
    """What ``optimize`` would fuse and what not, and why: the same passes on a copy of ``model`` (so the report
    lists what the passes after the chains do too: concatenation buffers, virtual concatenations, channel
    scales, pooled depthwise convs), with no kernel compiled or run. ``model`` is not changed."""
    policy = Precision.parse(precision)
    ops.check_backend(backend)
    _, report = _run_pipeline(_working_copy(model, inplace=False), _as_inputs(example_inputs), policy, backend)
    return report


def _traced_leftovers(model: nn.Module) -> list[str]:
    """The module attributes (and their list, tuple or dict entries) holding fake or functional tensors: what
    tracing leaves in a model that caches tensors in its forward (ultralytics' Detect head keeps its anchors),
    and what then makes it impossible to copy."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    def entries(key: str, value: Any) -> list[tuple[str, Any]]:
        if isinstance(value, dict):
            return [(f"{key}[{k!r}]", v) for k, v in value.items()]
        if isinstance(value, (list, tuple)):
            return [(f"{key}[{i}]", v) for i, v in enumerate(value)]
        return [(key, value)]

    found = []
    for prefix, module in model.named_modules():
        values = {**module._parameters, **module._buffers, **{k: v for k, v in vars(module).items() if k[0] != "_"}}
        for key, value in values.items():
            for name, entry in entries(key, value):
                if isinstance(entry, (FakeTensor, FunctionalTensor)):
                    found.append(f"{prefix}.{name}" if prefix else name)
    return found


def _working_copy(model: Any, inplace: bool) -> nn.Module:
    if isinstance(model, nn.Module):
        if inplace:
            return model
        try:
            return copy.deepcopy(model)
        except Exception as error:
            traced = _traced_leftovers(model)
            cause = (
                f"{', '.join(f'`{name}`' for name in traced[:4])} hold fake tensors that tracing (torch.export, "
                "torch.onnx.export(dynamo=True), torch.compile) left in the model: build or load it again, or "
                "optimize it before exporting it"
                if traced
                else "pass inplace=True to optimize the model itself"
            )
            raise TypeError(
                f"cannot copy the {type(model).__name__} to optimize it ({type(error).__name__}: {error}); {cause}"
            ) from error
    if isinstance(model, (str, os.PathLike)):
        path = Path(model)
        if not path.exists():
            raise FileNotFoundError(f"fuser: no such model file: {path}")
        from fuser.onnx.importer import import_onnx

        return import_onnx(path)
    if type(model).__name__ == "ModelProto" and type(model).__module__.startswith("onnx"):
        from fuser.onnx.importer import import_onnx

        return import_onnx(model)
    raise TypeError(
        "fuser expects a torch.nn.Module, a path to an .onnx file or an onnx.ModelProto; "
        f"got {type(model).__module__}.{type(model).__qualname__}"
    )


def _as_inputs(example_inputs: Any) -> tuple[Any, ...] | None:
    if example_inputs is None:
        return None
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs)
    raise TypeError(f"example_inputs must be a tensor or a tuple of inputs, got {type(example_inputs).__name__}")


def _on_cuda(inputs: tuple[Any, ...]) -> bool:
    return any(isinstance(t, torch.Tensor) and t.is_cuda for t in inputs)


def _describe_inputs(inputs: tuple[Any, ...]) -> str:
    return ", ".join(
        f"{tuple(t.shape)} {str(t.dtype).removeprefix('torch.')} on {t.device}"
        if isinstance(t, torch.Tensor)
        else type(t).__name__
        for t in inputs
    )


def _capture(working: nn.Module, inputs: tuple[Any, ...] | None = None, keep: frozenset[int] = frozenset()) -> Capture:
    """The model's graphs: an fx.GraphModule (an imported ONNX model) as it is; else traced, and traced again
    for the example inputs' sizes where :func:`~fuser.capture.specialize.prefer_specialized` says so (an image
    model that does not trace whole)."""
    if isinstance(working, fx.GraphModule):
        return Capture(root=working, graphs=[CapturedGraph("", working, working)])
    return prefer_specialized(capture(working), working, inputs, keep)


def strict() -> bool:
    """``FUSER_STRICT=1``: an internal error inside a pass raises instead of leaving that graph as it is.

    Outside strict mode such an error costs only the fusions of one graph (the model stays correct), so it
    is a warning and a report entry; the test suite runs strict, so a bug in a pass cannot hide there.
    """
    return os.environ.get("FUSER_STRICT", "") not in ("", "0")


def _run_pipeline(
    working: nn.Module, inputs: tuple[Any, ...] | None, policy: Precision, backend: str
) -> tuple[nn.Module, FusionReport]:
    heads = find_detect_heads(working)  # before capture, which moves the heads' parameters into graphs
    captured = _capture(working, inputs, frozenset(id(h.module) for h in heads.heads))
    # a graph specialized to the example's sizes runs only those: other calls run the model as it is now
    original = cpu_copy(working) if captured.specialization is not None else None
    if inputs is not None:
        try:
            propagate_shapes(working, captured, inputs)
        except Exception as error:
            raise ValueError(
                f"the model raised {type(error).__name__} on the example inputs ({_describe_inputs(inputs)}): {error}"
            ) from error
    report = FusionReport(untraced=captured.untraced, precision=policy.value, backend=backend)
    root = working
    for graph in captured.graphs:
        try:
            fired = canonicalize(graph.gm)
            rewrites = fuse_pool_pyramids(graph.gm, backend) + fuse_max_pools(graph.gm, backend)
            rewrites += fuse_channel_means(graph.gm, backend)
            result = find_chains(graph.gm, graph.path)
            entries = [
                ChainReport.from_chain(c, True, kernel=_kernel_for(c, graph.gm, backend)) for c in result.accepted
            ]
            entries += [ChainReport.from_chain(r.chain, False, reason=r.reason) for r in result.rejected]
            rewritten = rewrite_chains(graph.gm, result.accepted, policy, backend) or bool(rewrites)
            if rewritten:
                # pads into the convs' padding first: a conv that reads its producer directly lets that
                # producer store TF32-rounded values
                rewrites += fold_zero_pads(graph.gm)
                # TF32 rounding then: it must see the multiplies and concatenations the passes below fold
                # into the convs' operand loads (a folded product is truncated, not stored rounded).
                mark_tf32_rounded_outputs(graph.gm)
                compensate_truncated_inputs(graph.gm)
                rewrites += fuse_virtual_cats(graph.gm) + eliminate_cats(graph.gm) + fold_input_scales(graph.gm)
            # also where no chain was fused: a BatchNorm before a lone conv fuses that conv
            folds = fold_batch_norms_forward(graph.gm, policy, backend)
            # last: the passes before it rewrite fused convs, which this one moves into pooled modules
            changed = folds + fuse_depthwise_pools(graph.gm)
            rewrites, rewritten = rewrites + changed, rewritten or any(r.eliminated for r in changed)
            entries = settle_kernels(settle_batch_norms(entries, rewrites), rewrites)
        except Exception as error:  # never fail the user's model over one graph: leave it as it was
            if strict():
                raise
            reason = f"fuser failed on its graph ({type(error).__name__}: {error}); left as it is - please report"
            warnings.warn(f"fuser: {graph.path or '(model)'}: {reason}", RuntimeWarning, stacklevel=3)
            report.untraced.append(UntracedModule(graph.path or "(model)", type(graph.module).__name__, reason))
            continue
        report.entries += entries
        report.add_rules_fired(fired)
        report.rewrites += rewrites
        if rewritten:
            root = install(captured, graph, graph.gm)
    report.rewrites += heads.rewrites()
    report.skipped += heads.skipped()
    install_detect_heads(heads, root, backend)
    if captured.specialization is not None and root is not working:
        assert original is not None
        root = ShapeGuard(root, original, captured.specialization, type(working).__name__)
        report.specialized = captured.specialization.describe()
    return root, report


def _kernel_for(chain: Chain, gm: fx.GraphModule, backend: str) -> str:
    """Which Triton kernel the chain runs on a GPU, for the report (the halo conv only where ``backend`` runs
    compiled kernels: the interpreter never takes its route)."""
    try:
        from fuser.lower import kernel_dispatch
    except ImportError:  # no triton on this machine: the reference runs everywhere
        return "torch reference"
    builds = chain.pattern.builds
    if builds is FUSED_LINEAR:
        return kernel_dispatch.kernel_name("gemm")
    args = bind(chain.head, builds.args, builds.defaults)
    weight = constant_tensor(gm, args["weight"])
    groups = int(args["groups"])
    stride, dilation = (
        tuple(v) if isinstance(v, (tuple, list)) else (v,) * 2 for v in (args["stride"], args["dilation"])
    )
    return kernel_dispatch.conv_kernel_name(weight.shape, groups, stride, args["padding"], dilation, backend)
