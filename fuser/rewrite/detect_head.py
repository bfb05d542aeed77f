"""YOLO detect heads (ultralytics' ``Detect``): everything after the per-level conv branches as one kernel.

``Detect`` does not trace (it compares the input shape with the one its anchors were made for), so capture
optimizes its branch convs one by one and the inference tail runs eagerly: two concatenations of views over
levels, DFL (view, transpose, softmax, a 1x1 conv with weights 0..reg_max-1), ``dist2bbox`` (chunk, sub,
add, cat), the multiplication by the strides, the sigmoid of the class scores and the final concatenation:
a dozen small kernels per forward. :func:`find_detect_heads` recognizes a ``Detect`` whose inference path is
ultralytics' own (the class's methods, not a subclass's overrides) and :func:`install_detect_heads` gives it
a forward (:class:`FusedDetectForward`) that runs the same branches and the same anchor logic (ultralytics'
``make_anchors``, called when the input shape changes, exactly as ``Detect`` does) and then one launch of
``fuser.kernels.detect_head``, which writes the decoded ``[N, 4 + nc, A]`` output and the two raw
concatenations the head also returns.

Only the default inference path is fused: in training, with an end-to-end (one-to-one) head, or when the
branches' outputs are not what the head expects, the forward is the class's own. Heads that override the
tail (Segment, Pose, OBB, v10Detect, ...) are left as they are and listed in the report with the reason.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fuser.graph_ops import unused_name
from fuser.kernels.detect_head import detect_head_reference
from fuser.lower import ops
from fuser.lower.backends import KERNEL_DTYPES
from fuser.lower.plan_table import KeepsPlans, PlanTable
from fuser.report import GraphRewrite, SkippedRewrite

# The methods of Detect whose code the fused forward stands for: a class that overrides one computes
# something else (Segment adds mask coefficients, Pose keypoints, OBB angles).
# The ultralytics releases whose Detect.forward the fused forward mirrors (checked against 8.4's code).
VERSIONS = ("8.4.",)
TAIL_METHODS = ("forward", "forward_head", "_inference", "_get_decode_boxes", "decode_bboxes", "one2many")
ELIMINATED = ["cat(boxes)", "cat(scores)", "dfl", "dist2bbox", "mul(strides)", "sigmoid", "cat(y)"]


def _detect_class(module: nn.Module) -> type | None:
    """ultralytics' ``Detect`` when ``module`` is one (or a subclass), else None."""
    for cls in type(module).__mro__:
        if cls.__name__ == "Detect" and cls.__module__.startswith("ultralytics."):
            return cls
    return None


def _refusal(module: nn.Module, detect: type) -> str | None:
    """Why ``module`` (a ``Detect``) is not fused, or None when its inference path is Detect's own."""
    version = str(getattr(sys.modules.get("ultralytics"), "__version__", "unknown"))
    if not version.startswith(VERSIONS):
        return f"ultralytics {version}: the fused forward mirrors Detect of ultralytics {', '.join(VERSIONS)}x only"
    cls = type(module)
    overridden = [name for name in TAIL_METHODS if _defining_class(cls, name) is not detect]
    if overridden:
        return f"{cls.__name__} overrides Detect.{', Detect.'.join(overridden)}; its head runs as it is"
    if "forward" in module.__dict__:
        return "its forward was replaced on the instance; its head runs as it is"
    if getattr(module, "one2one_cv2", None) is not None:
        return "it has an end-to-end (one-to-one) head; only heads without one are fused"
    if not callable(detect._get_decode_boxes.__globals__.get("make_anchors")):
        return "Detect's module has no make_anchors to make the anchors with"
    dfl_class = detect.__init__.__globals__.get("DFL")
    dfl = getattr(module, "dfl", None)
    if dfl_class is None or type(dfl) is not dfl_class or "forward" in dfl.__dict__:
        return f"its dfl is a {type(dfl).__name__}, not ultralytics' DFL (reg_max={module.reg_max})"
    weight = getattr(getattr(dfl, "conv", None), "weight", None)
    if (
        not isinstance(weight, torch.Tensor)
        or tuple(weight.shape) != (1, module.reg_max, 1, 1)
        or dfl.c1 != module.reg_max
    ):
        return f"its DFL's conv weight has shape {getattr(weight, 'shape', None)}, not (1, reg_max, 1, 1)"
    branches = (getattr(module, "cv2", None), getattr(module, "cv3", None))
    if any(not isinstance(b, nn.ModuleList) or len(b) != module.nl for b in branches):
        return "its cv2 / cv3 are not one branch per level"
    return None


def _defining_class(cls: type, name: str) -> type | None:
    return next((c for c in cls.__mro__ if name in c.__dict__), None)


@dataclass
class DetectHead:
    """One ``Detect`` of the working model, what its fusion would be, or why there is none."""

    path: str
    module: nn.Module
    dfl_weight: torch.Tensor | None = None
    reason: str | None = None


@dataclass
class DetectHeads:
    heads: list[DetectHead] = field(default_factory=list)

    @property
    def fused(self) -> list[DetectHead]:
        return [h for h in self.heads if h.reason is None]

    def rewrites(self) -> list[GraphRewrite]:
        return [
            GraphRewrite(
                "detect_head",
                h.path,
                f"DFL + dist2bbox + strides + sigmoid + cats over {h.module.nl} levels (nc={h.module.nc}, "
                f"reg_max={h.module.reg_max}): one kernel",
                list(ELIMINATED),
            )
            for h in self.fused
        ]

    def skipped(self) -> list[SkippedRewrite]:
        return [SkippedRewrite("detect_head", h.path, h.reason) for h in self.heads if h.reason is not None]


def find_detect_heads(model: nn.Module) -> DetectHeads:
    """Every ultralytics ``Detect`` in ``model``, with its DFL weights read now (capture then moves the
    branch modules' parameters into their graphs) or the reason it stays as it is."""
    found = DetectHeads()
    for path, module in model.named_modules():
        detect = _detect_class(module)
        if detect is None:
            continue
        reason = _refusal(module, detect)
        weight = None if reason is not None else module.dfl.conv.weight.detach().reshape(-1).clone()
        found.heads.append(DetectHead(path or "(model)", module, weight, reason))
    return found


def install_detect_heads(heads: DetectHeads, root: nn.Module, backend: str) -> None:
    """Give every fusable head found in ``root`` the fused forward (a child ``fused_head`` holds its state)."""
    present = {id(m) for m in root.modules()}
    for head in heads.fused:
        module = head.module
        if id(module) not in present:
            continue
        assert head.dfl_weight is not None
        name = unused_name(module, "fused_head")
        module.add_module(name, FusedDetectTail(head.dfl_weight, backend, head.path))
        # The make_anchors that Detect's own code calls (a global of its module).
        make_anchors = type(module)._get_decode_boxes.__globals__["make_anchors"]
        object.__setattr__(module, "forward", FusedDetectForward(module, name, make_anchors))


class FusedDetectTail(KeepsPlans, nn.Module):
    """The fused tail of one head: ``(y, boxes, scores)`` from the per-level branch outputs (the kernel where
    it applies, :func:`detect_head_reference` elsewhere: CPU, torch.compile, exporters, float64)."""

    def __init__(self, dfl_weight: torch.Tensor, backend: str = "auto", source: str = "") -> None:
        super().__init__()
        self.register_buffer("dfl_weight", dfl_weight)
        self.backend = ops.check_backend(backend)
        self.source = source
        self._plans = PlanTable()

    def _kernel_applies(self, tensors: list[torch.Tensor]) -> bool:
        if torch.compiler.is_compiling() or torch.jit.is_tracing() or ops.is_decomposed():
            return False
        first = tensors[0]
        if any(type(t) is not torch.Tensor for t in tensors) or first.dtype not in KERNEL_DTYPES:
            return False
        if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
            return False
        return ops.resolve_backend(self.backend, first.device) in ("triton", "measured", "interpret")

    def forward(
        self,
        box_levels: list[torch.Tensor],
        cls_levels: list[torch.Tensor],
        anchors: torch.Tensor,
        strides: torch.Tensor,
        xywh: bool,
        raw: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        tensors = [*box_levels, *cls_levels, anchors, strides]
        plan = (
            self._plan(box_levels, cls_levels, anchors, strides, xywh, raw) if self._kernel_applies(tensors) else None
        )
        if plan is None:
            return detect_head_reference(box_levels, cls_levels, anchors, strides, self.dfl_weight, xywh=xywh)
        return plan(box_levels, cls_levels, anchors, strides, self.dfl_weight)

    def _plan(
        self,
        box_levels: list[torch.Tensor],
        cls_levels: list[torch.Tensor],
        anchors: torch.Tensor,
        strides: torch.Tensor,
        xywh: bool,
        raw: bool,
    ) -> Callable[..., Any] | None:
        """The kernel's launch plan for this signature, or None where the levels are not what the kernel
        takes (the reference then computes it, and raises what ultralytics' own code would)."""
        from fuser.kernels.detect_head import prepare_detect_head, unsupported
        from fuser.kernels.launch import tensor_meta

        key = (tuple(tensor_meta(t) for t in (*box_levels, *cls_levels, anchors, strides)), xywh, raw)

        def build() -> Callable[..., Any] | None:
            weight = self.dfl_weight
            if unsupported(box_levels, cls_levels, anchors, strides, weight) is not None:
                return None
            interpret = box_levels[0].device.type == "cpu"
            return prepare_detect_head(
                box_levels, cls_levels, anchors, strides, weight, xywh=xywh, raw=raw, interpret=interpret
            )

        return self._plans.get(key, build)

    def extra_repr(self) -> str:
        return f"reg_max={self.dfl_weight.numel()}, backend={self.backend}"


class FusedDetectForward:
    """The forward of a fused ``Detect``: its branches, its anchors, then the fused tail.

    Mirrors ``Detect.forward`` on its default inference path (eval, no one-to-one head), with
    ``Detect._get_decode_boxes``'s anchor cache (``shape``, ``anchors``, ``strides``, recomputed by
    ultralytics' ``make_anchors`` when the input shape changes or ``dynamic`` is set) kept as the head's own
    state, so the class's forward finds it valid. Any other call runs the class's forward."""

    def __init__(self, head: nn.Module, tail: str, make_anchors: Callable[..., Any]) -> None:
        self.head = head
        self.tail = tail
        self.make_anchors = make_anchors

    def __call__(self, x: Any) -> Any:
        head = self.head
        cls = type(head)
        if (
            head.training
            or getattr(head, "one2one_cv2", None) is not None
            or head.cv2 is None
            or head.cv3 is None
            or not isinstance(x, (list, tuple))
            or len(x) != head.nl
        ):
            return cls.forward(head, x)
        box_levels = [head.cv2[i](x[i]) for i in range(head.nl)]
        cls_levels = [head.cv3[i](x[i]) for i in range(head.nl)]
        shape = x[0].shape
        if head.dynamic or head.shape != shape:
            head.anchors, head.strides = (a.transpose(0, 1) for a in self.make_anchors(x, head.stride, 0.5))
            head.shape = shape
        export = head.export
        y, boxes, scores = getattr(head, self.tail)(
            box_levels, cls_levels, head.anchors, head.strides, not head.xyxy, not export
        )
        return y if export else (y, {"boxes": boxes, "scores": scores, "feats": x})
