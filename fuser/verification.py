"""``fuser.verify``: does the optimized model still give the original's answers, and if not, where it stops.

    result = fuser.verify(model, optimized, (x,))
    print(result)            # output error, cosine, top-1 / box agreement, per-layer table, first bad layer
    assert result.ok

The reference is the original model run in float64 (on a copy). Four things are compared:

- the outputs: ||out - ref|| / ||ref|| over all floating-point output tensors (the outputs are
  pytree-flattened, so tuples, lists and dicts of tensors work), and their cosine similarity;
- what a user reads off them: top-1 agreement for a classifier (one 2-D ``[batch, classes]`` output) and
  box agreement for a detector (see :func:`detections`: YOLO-style ``[batch, 4 + classes, anchors]`` with
  decoded xywh boxes, and torchvision's list of ``{"boxes", "labels", "scores"}`` dicts);
- every fused layer: its output against the value the original model computes at the same point (the
  last node of the chain it replaced, recorded from a float64 trace of the original), in execution order.
  An error that first crosses the budget at layer k, with the layers before it clean, names the chain to
  blame; its "own" error (the fused op against itself in float64, on the inputs it got) says which way:
  a small own error means the folded parameters differ from the original chain (a fusion bug), a large
  one means the kernel's arithmetic at this precision is what drifts;
- ``ok``: the output error is within the budget (default: :data:`TOLERANCE` for the model's precision).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_flatten

# Relative error bound against a float64 reference, by precision policy: per fused layer and per model.
TOLERANCE: dict[str, float] = {
    "ieee": 1e-5,
    "tf32x3": 1e-5,
    "tf32": 2e-3,
    "bf16": 2e-2,
    "fp16": 2e-2,
}

# Detections: a reference box counts as kept when the optimized output has one of the same class at this IoU.
IOU_MATCH = 0.5
CONF_THRESHOLD = 0.25
MAX_DETECTIONS = 300


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf when ``out`` holds a NaN or inf, or the shapes differ."""
    out64, ref64 = out.detach().double().cpu(), ref.detach().double().cpu()
    if out64.shape != ref64.shape or not torch.isfinite(out64).all():
        return math.inf
    denom = ref64.norm().item()
    return (out64 - ref64).norm().item() / (denom if denom > 0 else 1.0)


def _cosine(out: torch.Tensor, ref: torch.Tensor) -> float:
    a, b = out.detach().double().cpu().flatten(), ref.detach().double().cpu().flatten()
    if a.shape != b.shape or not torch.isfinite(a).all():
        return math.nan
    denom = (a.norm() * b.norm()).item()
    return (a @ b).item() / denom if denom > 0 else 1.0


@dataclass(frozen=True)
class LayerCheck:
    """One call of one fused layer: its output against the original model's value at the same point."""

    index: int  # execution order in the optimized forward
    name: str  # the fused module's qualified name in the optimized model
    source: str  # the modules of the chain it replaced, in the user's model
    ops: str  # the chain, e.g. "conv2d -> batch_norm -> silu"
    rel_error: float  # against the original, float64
    cosine: float
    own_error: float  # against the same fused op in float64 on the same inputs: the kernel's own arithmetic


@dataclass
class VerifyResult:
    """What :func:`verify` found. ``ok`` is True when the output error is within ``budget``."""

    precision: str
    budget: float
    rel_error: float
    cosine: float
    baseline_error: float  # the original model itself run in its own dtype, against float64
    top1_agreement: float | None = None
    box_agreement: float | None = None
    layers: list[LayerCheck] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.rel_error <= self.budget

    @property
    def first_bad_layer(self) -> LayerCheck | None:
        """The first fused layer, in execution order, whose output error crosses the budget."""
        return next((layer for layer in self.layers if not layer.rel_error <= self.budget), None)

    def blame(self) -> str:
        """One sentence: which layer, and whether its fusion or its precision is to blame."""
        bad = self.first_bad_layer
        if bad is None:
            if self.ok:
                return "every fused layer is within the budget"
            return "no fused layer crosses the budget: the error comes from the unfused ops or adds up slowly"
        if bad.own_error <= self.budget / 10:
            why = "its kernel reproduces its own parameters, so the folded parameters (the fusion) are wrong"
        else:
            why = f"its kernel is off by {bad.own_error:.1e} against itself: the precision ({self.precision})"
        return f"first layer over the budget: #{bad.index} {bad.name} ({bad.source}: {bad.ops}); {why}"

    def __str__(self) -> str:
        verdict = "OK" if self.ok else "FAILED"
        lines = [
            f"fuser.verify: {verdict}: relative error {self.rel_error:.2e} against float64 (budget {self.budget:g}, "
            f"precision {self.precision}); cosine {self.cosine:.8f}; original in its own dtype: "
            f"{self.baseline_error:.2e}"
        ]
        if self.top1_agreement is not None:
            lines.append(f"  top-1 labels agree with float64 on {self.top1_agreement:.2%} of the batch")
        if self.box_agreement is not None:
            lines.append(
                f"  detections kept (same class, IoU >= {IOU_MATCH}) against float64: {self.box_agreement:.2%}"
            )
        if self.layers:
            bad = self.first_bad_layer
            lines += ["", f"Fused layers ({len(self.layers)} calls), error against the original at the same point:"]
            header = ["#", "layer", "chain", "rel. error", "cosine", "own error"]
            rows = [
                [
                    str(c.index),
                    c.source,
                    c.ops,
                    f"{c.rel_error:.2e}",
                    f"{c.cosine:.6f}",
                    f"{c.own_error:.1e}" + ("  <- first over budget" if c is bad else ""),
                ]
                for c in self.layers
            ]
            lines += _table(header, rows)
        if not self.ok or self.first_bad_layer is not None:
            lines += ["", self.blame()]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "precision": self.precision,
            "budget": self.budget,
            "rel_error": self.rel_error,
            "cosine": self.cosine,
            "baseline_error": self.baseline_error,
            "top1_agreement": self.top1_agreement,
            "box_agreement": self.box_agreement,
            "first_bad_layer": None if self.first_bad_layer is None else self.first_bad_layer.__dict__,
            "layers": [c.__dict__ for c in self.layers],
            "notes": self.notes,
        }

    def plot(self, path: str | Path, title: str = "") -> Path:
        """Draw the error of every fused layer (execution order, log scale) and the budget to ``path``.

        Needs matplotlib (``pip install fuser[plot]``)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as error:
            raise ImportError("VerifyResult.plot needs matplotlib: pip install 'fuser[plot]'") from error
        path = Path(path)
        fig, ax = plt.subplots(figsize=(max(6.0, 0.12 * len(self.layers)), 3.6))
        values = [max(c.rel_error, 1e-12) if math.isfinite(c.rel_error) else 1.0 for c in self.layers]
        bad = self.first_bad_layer
        colors = ["tab:red" if bad is not None and c.index >= bad.index else "tab:blue" for c in self.layers]
        ax.bar(range(len(values)), values, color=colors)
        ax.axhline(self.budget, color="tab:red", linestyle="--", label=f"budget {self.budget:g} ({self.precision})")
        ax.set_yscale("log")
        ax.set_xlabel("fused layer (execution order)")
        ax.set_ylabel("relative error vs float64 original")
        ax.set_title(title or f"fuser.verify: error per fused layer (output {self.rel_error:.1e})", fontsize=9)
        ax.legend(loc="upper left")
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in range(len(header))]
    fmt = lambda cells: "  " + "  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip()
    return [fmt(header), fmt(["-" * w for w in widths]), *map(fmt, rows)]


# ---------------------------------------------------------------------------------------------------------
# Outputs


def _to64(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        return value.double()
    if isinstance(value, (tuple, list)):
        return type(value)(_to64(v) for v in value)
    if isinstance(value, dict):
        return {k: _to64(v) for k, v in value.items()}
    return value


def _float_leaves(value: Any) -> list[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]


def output_error(out: Any, ref: Any) -> tuple[float, float, list[str]]:
    """(relative error, cosine) over all floating-point tensors of two pytrees, and notes on what was skipped.

    Tensors whose shapes differ (a detector's post-NMS boxes, when the two runs keep different numbers) are
    left out of the error, with a note: they are compared through :func:`box_agreement` instead."""
    outs, refs = _float_leaves(out), _float_leaves(ref)
    if len(outs) != len(refs):
        raise ValueError(f"the optimized model returns {len(outs)} floating-point tensors, the original {len(refs)}")
    notes, diff2, ref2, dot, out2 = [], 0.0, 0.0, 0.0, 0.0
    for i, (o, r) in enumerate(zip(outs, refs, strict=True)):
        if o.shape != r.shape:
            notes.append(f"output tensor {i} has shape {tuple(o.shape)} against {tuple(r.shape)}: not in the error")
            continue
        o64, r64 = o.detach().double().cpu(), r.detach().double().cpu()
        if not torch.isfinite(o64).all():
            return math.inf, math.nan, [*notes, f"output tensor {i} holds NaN or inf"]
        diff2 += (o64 - r64).square().sum().item()
        ref2 += r64.square().sum().item()
        out2 += o64.square().sum().item()
        dot += (o64 * r64).sum().item()
    error = math.sqrt(diff2) / (math.sqrt(ref2) if ref2 > 0 else 1.0)
    cosine = dot / math.sqrt(out2 * ref2) if out2 > 0 and ref2 > 0 else 1.0
    return error, cosine, notes


def top1_agreement(out: Any, ref: Any) -> float | None:
    """Share of rows whose argmax agrees, for a classifier: an output that is one 2-D [batch, classes] tensor
    (classes > 1); None for any other output."""
    outs, refs = _float_leaves(out), _float_leaves(ref)
    if len(outs) != 1 or outs[0].dim() != 2 or outs[0].shape[1] < 2 or outs[0].shape != refs[0].shape:
        return None
    return (outs[0].argmax(1).cpu() == refs[0].argmax(1).cpu()).double().mean().item()


@dataclass(frozen=True)
class Detections:
    """One image's detections: boxes [n, 4] as x1, y1, x2, y2; labels [n]; scores [n]."""

    boxes: torch.Tensor
    labels: torch.Tensor
    scores: torch.Tensor


def detections(output: Any) -> list[Detections] | None:
    """The detections in a model's output, per image, or None when the output is not a recognised format.

    Recognised: (1) a list of dicts with "boxes" [n, 4] (x1, y1, x2, y2), "labels" and "scores", as
    torchvision's detection models return in eval mode (kept as they are); (2) YOLO-style decoded
    predictions, the first tensor of the output being [batch, 4 + classes, anchors] with anchors > 4 +
    classes and the boxes as centre x, centre y, width, height (ultralytics' Detect head in eval mode): per
    image the anchors whose best class score is at least CONF_THRESHOLD, at most MAX_DETECTIONS by score,
    before NMS (NMS would hide a wrong box behind a right one). Extra channels (segmentation mask
    coefficients, keypoints) are not recognised as such: they count as classes.
    """
    if isinstance(output, (list, tuple)) and output and all(isinstance(d, dict) for d in output):
        if all({"boxes", "labels", "scores"} <= set(d) for d in output):
            return [
                Detections(d["boxes"].detach().cpu(), d["labels"].cpu(), d["scores"].detach().cpu()) for d in output
            ]
        return None
    leaves = _float_leaves(output)
    if not leaves:
        return None
    pred = leaves[0].detach().cpu()
    if pred.dim() != 3 or pred.shape[1] <= 4 or pred.shape[2] <= pred.shape[1]:
        return None
    found = []
    for image in pred:
        xywh, cls = image[:4].T, image[4:].T
        scores, labels = cls.max(1)
        keep = (scores >= CONF_THRESHOLD).nonzero().flatten()
        keep = keep[scores[keep].argsort(descending=True)[:MAX_DETECTIONS]]
        xy, wh = xywh[keep, :2], xywh[keep, 2:]
        found.append(Detections(torch.cat([xy - wh / 2, xy + wh / 2], 1), labels[keep], scores[keep]))
    return found


def _box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    area = lambda t: (t[:, 2] - t[:, 0]).clamp_min(0) * (t[:, 3] - t[:, 1]).clamp_min(0)
    lt = torch.maximum(a[:, None, :2], b[None, :, :2])
    rb = torch.minimum(a[:, None, 2:], b[None, :, 2:])
    inter = (rb - lt).clamp_min(0).prod(2)
    return inter / (area(a)[:, None] + area(b)[None, :] - inter).clamp_min(1e-12)


def box_agreement(out: Any, ref: Any) -> float | None:
    """Share of the reference's detections that the optimized output also has: a box of the same class at
    IoU >= IOU_MATCH, each optimized box matched at most once (greedily, by reference score). None when
    the output is not a recognised detection format or the reference detects nothing."""
    found, expected = detections(out), detections(ref)
    if found is None or expected is None or len(found) != len(expected):
        return None
    matched = total = 0
    for f, e in zip(found, expected, strict=True):
        total += len(e.scores)
        if not len(e.scores) or not len(f.scores):
            continue
        iou = _box_iou(e.boxes.double(), f.boxes.double())
        iou[e.labels[:, None] != f.labels[None, :]] = 0
        for i in e.scores.argsort(descending=True).tolist():
            j = int(iou[i].argmax())
            if iou[i, j] >= IOU_MATCH:
                matched += 1
                iou[:, j] = 0
    return matched / total if total else None


# ---------------------------------------------------------------------------------------------------------
# Layers


@dataclass
class _Fused:
    name: str  # qualified name in the optimized model
    module: nn.Module
    key: tuple[str, str]  # (graph path, the chain's last node in the original's canonical graph)
    source: str
    ops: str


def _graph_modules(optimized: nn.Module) -> dict[str, tuple[str, fx.GraphModule]]:
    """Each traced graph of the optimized model by its path in the user's model: (prefix in optimized, gm)."""
    from fuser.api import OptimizedModule
    from fuser.capture.specialize import ShapeGuard

    root = optimized.module if isinstance(optimized, OptimizedModule) else optimized
    prefix = "module." if isinstance(optimized, OptimizedModule) else ""
    if isinstance(root, ShapeGuard):  # a graph traced for the example's sizes (fuser.capture.specialize)
        root, prefix = root.graph, f"{prefix}graph."
    found: dict[str, tuple[str, fx.GraphModule]] = {}
    if isinstance(root, fx.GraphModule):
        found[""] = (prefix, root)
    for path, module in root.named_modules():
        forward = module.__dict__.get("forward")
        gm = getattr(forward, "__self__", None)
        child = next((n for n, m in module.named_children() if m is gm), None)
        if path and isinstance(gm, fx.GraphModule) and child is not None:
            found[path] = (f"{prefix}{path}.{child}.", gm)
    return found


def _fused_children(gm: nn.Module) -> list[tuple[str, nn.Module]]:
    """``gm``'s children in order, a depthwise conv paired with its pool (fuser.rewrite.depthwise_pool) as that
    conv, which is the layer its chain made."""
    from fuser.rewrite.depthwise_pool import PooledDepthwise

    return [(f"{n}.conv", m.conv) if isinstance(m, PooledDepthwise) else (n, m) for n, m in gm.named_children()]


def _fused_layers(optimized: nn.Module) -> tuple[list[_Fused], list[str]]:
    """The fused modules of ``optimized``, each tied to the chain its fusion report lists for it."""
    from fuser.lower.fused_modules import FusedConv2d, FusedLinear

    report = getattr(optimized, "fusion_report", None)
    if report is None:
        return [], ["the optimized model has no fusion_report: its layers are not compared"]
    graphs = _graph_modules(optimized)
    layers, notes = [], []
    by_graph: dict[str, list[Any]] = {}
    for entry in report.fused:
        by_graph.setdefault(entry.graph, []).append(entry)
    for path, entries in by_graph.items():
        if path not in graphs:
            notes.append(f"graph {path or '(model)'}: not found in the optimized model; its layers are not compared")
            continue
        prefix, gm = graphs[path]
        modules = [(n, m) for n, m in _fused_children(gm) if isinstance(m, (FusedConv2d, FusedLinear))]
        if len(modules) != len(entries):
            notes.append(f"graph {path or '(model)'}: {len(modules)} fused modules for {len(entries)} fused chains")
            continue
        for (name, module), entry in zip(modules, entries, strict=True):
            layers.append(
                _Fused(prefix + name, module, (path, entry.nodes[-1]), entry.location, " -> ".join(entry.ops))
            )
    return layers, notes


class _Recorder(fx.Interpreter):
    """Runs a graph and keeps the values of the ``wanted`` nodes, one list entry per call."""

    def __init__(self, gm: fx.GraphModule, wanted: set[str], store: dict[str, list[torch.Tensor]]) -> None:
        super().__init__(gm)
        self.wanted, self.store = wanted, store

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        if n.name in self.wanted and isinstance(result, torch.Tensor):
            self.store.setdefault(n.name, []).append(result.detach())
        return result


def _reference_values(
    model64: nn.Module, inputs64: tuple[Any, ...], kwargs64: dict[str, Any], wanted: dict[str, set[str]]
) -> tuple[Any, dict[tuple[str, str], list[torch.Tensor]], list[str]]:
    """Run the float64 copy of the original with its graphs captured and canonicalized as optimize() does, so
    the node names in the fusion report name the same values here; returns the output and those values."""
    from fuser.api import _capture
    from fuser.canonicalize import canonicalize
    from fuser.capture.tracing import propagate_shapes
    from fuser.rewrite.detect_head import find_detect_heads

    notes: list[str] = []
    store: dict[str, dict[str, list[torch.Tensor]]] = {}
    heads = frozenset(id(h.module) for h in find_detect_heads(model64).heads)
    captured = _capture(model64, None if kwargs64 else inputs64, heads)  # as optimize() captured it
    if kwargs64:
        notes.append("keyword inputs: the layers are not compared")
        captured.graphs = []
    else:
        propagate_shapes(model64, captured, inputs64)
    root_graph = None
    for g in captured.graphs:
        if g.path not in wanted:
            continue
        try:
            canonicalize(g.gm)
        except Exception as error:
            notes.append(f"graph {g.path or '(model)'}: not canonicalized again ({type(error).__name__}: {error})")
            continue
        values = store.setdefault(g.path, {})
        if g.path == "":
            root_graph = (g.gm, values)
            continue

        def forward(*args: Any, g: Any = g, values: Any = values, **kwargs: Any) -> Any:
            if kwargs:
                return type(g.module).forward(g.module, *args, **kwargs)
            return _Recorder(g.gm, wanted[g.path], values).run(*args)

        object.__setattr__(g.module, "forward", forward)
    with torch.no_grad():
        if root_graph is not None:
            gm, values = root_graph
            output = _Recorder(gm, wanted[""], values).run(*inputs64)
        else:
            output = model64(*inputs64, **kwargs64)
    flat = {(path, name): v for path, values in store.items() for name, v in values.items()}
    return output, flat, notes


def _layer_checks(
    layers: list[_Fused], reference: dict[tuple[str, str], list[torch.Tensor]], seen: list[tuple[int, Any, Any]]
) -> list[LayerCheck]:
    from fuser.diagnose import run_in_float64

    calls: dict[int, int] = {}
    checks = []
    for index, (i, inputs, output) in enumerate(seen, 1):
        layer = layers[i]
        call = calls.get(i, 0)
        calls[i] = call + 1
        expected = reference.get(layer.key, [])
        ref = expected[call] if call < len(expected) else None
        itself = run_in_float64(layer.module, inputs)
        checks.append(
            LayerCheck(
                index=index,
                name=layer.name,
                source=layer.source,
                ops=layer.ops,
                rel_error=math.nan if ref is None else rel_error(output, ref),
                cosine=math.nan if ref is None else _cosine(output, ref),
                own_error=rel_error(output, itself),
            )
        )
    return checks


def _precision_of(optimized: nn.Module) -> str:
    precision = getattr(optimized, "precision", "ieee")
    return getattr(precision, "value", str(precision))


def verify(
    model: nn.Module,
    optimized: nn.Module,
    inputs: Any,
    *,
    budget: float | None = None,
    kwargs: dict[str, Any] | None = None,
    layers: bool = True,
) -> VerifyResult:
    """Check ``optimized`` against ``model`` run in float64 on ``inputs``; neither model is changed.

    Args:
        model: the original model (it is copied; the float64 run happens on the copy).
        optimized: what ``fuser.optimize(model, ...)`` returned (any module with the same outputs works for
            the output checks; the per-layer table needs its ``fusion_report``).
        inputs: a tensor or a tuple of positional inputs; floating-point ones are cast to float64 for the
            reference.
        budget: the largest relative error that passes; default: TOLERANCE for the optimized model's precision.
        kwargs: keyword inputs of both models, if any (the per-layer table then is not made).
        layers: False skips the per-layer comparison (one forward of each model instead of two).

    Returns a :class:`VerifyResult`; ``print`` it for the table, ``.ok`` for the verdict, ``.plot(path)`` for
    the picture.
    """
    args = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    kwargs = dict(kwargs or {})
    precision = _precision_of(optimized)
    budget = TOLERANCE.get(precision, TOLERANCE["tf32"]) if budget is None else float(budget)

    fused, notes = _fused_layers(optimized) if layers and not kwargs else ([], [])
    wanted: dict[str, set[str]] = {}
    for layer in fused:
        wanted.setdefault(layer.key[0], set()).add(layer.key[1])

    from fuser.diagnose import recorded_inputs

    seen: list[tuple[int, Any, Any]] = []
    handles = []
    for i, layer in enumerate(fused):

        def hook(module: nn.Module, hook_args: tuple, hook_kwargs: dict, output: Any, i: int = i) -> None:
            seen.append((i, recorded_inputs(hook_args, hook_kwargs), output.detach()))

        handles.append(layer.module.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            out = optimized(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()

    model64 = copy.deepcopy(model).double()
    ref, reference, ref_notes = _reference_values(model64, _to64(args), _to64(kwargs), wanted)
    del model64
    with torch.no_grad():
        baseline = copy.deepcopy(model)(*args, **kwargs)
    error, cosine, out_notes = output_error(out, ref)
    baseline_error, _, _ = output_error(baseline, ref)
    result = VerifyResult(
        precision=precision,
        budget=budget,
        rel_error=error,
        cosine=cosine,
        baseline_error=baseline_error,
        top1_agreement=top1_agreement(out, ref),
        box_agreement=box_agreement(out, ref),
        layers=_layer_checks(fused, reference, seen),
        notes=[*notes, *ref_notes, *out_notes],
    )
    if fused and not seen:
        result.notes.append("no fused module ran as a module (CUDA-graph replay?): the layers are not compared")
    return result
