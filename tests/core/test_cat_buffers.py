"""Concatenation elimination (fuser.rewrite.cat_buffers): fused convs store into the channel slices of the buffer a
channel ``torch.cat`` would copy them into. C2f- and DenseNet-like blocks with odd channel counts against
float64, the graph and the report, repeated calls, the guards, torch.compile, ONNX export; the compiled
kernels on a GPU; every C2f cat of the YOLOv8n replica."""

from __future__ import annotations

from collections import Counter

import onnx
import onnxruntime as ort
import pytest
import torch
import torch._dynamo
from accuracy import assert_close, reference64
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode
from toy_models import seeded

import fuser
from fuser import models
from fuser.kernels.epilogue import Activation, Epilogue
from fuser.lower.conv_geometry import ConvGeometry
from fuser.lower.fused_modules import FusedConv2d
from fuser.rewrite.cat_buffers import cat_result


def conv_bn_act(c_in: int, c_out: int, k: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, k, padding=k // 2, bias=False), nn.BatchNorm2d(c_out), nn.SiLU())


class C2fLike(nn.Module):
    """YOLOv8's C2f with odd widths: 1x1 conv, chunk in two, bottlenecks on the last piece (one with a
    shortcut add), cat of everything, 1x1 conv."""

    def __init__(self, c_in: int = 7, c: int = 5, n: int = 2) -> None:
        super().__init__()
        self.cv1 = conv_bn_act(c_in, 2 * c)
        self.m = nn.ModuleList(nn.Sequential(conv_bn_act(c, c, 3), conv_bn_act(c, c, 3)) for _ in range(n))
        self.cv2 = conv_bn_act((2 + n) * c, 9)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        halves = self.cv1(x).chunk(2, 1)
        y = [halves[0], halves[1]]  # indexed, not list(...): a traced value cannot be iterated
        for i, m in enumerate(self.m):
            y.append(m(y[-1]) + y[-1] if i == 0 else m(y[-1]))
        return self.cv2(torch.cat(y, 1))


class DenseLike(nn.Module):
    """DenseNet-style: each layer reads the cat of the input and all earlier outputs. Each fused conv writes
    the first cat it feeds; the block input and the outputs read again by later cats are copied in."""

    def __init__(self, c_in: int = 5, growth: int = 3, layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.ModuleList(conv_bn_act(c_in + i * growth, growth, 3) for i in range(layers))
        self.head = nn.Conv2d(c_in + layers * growth, 7, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.layers:
            features.append(layer(torch.cat(features, 1) if len(features) > 1 else x))
        return self.head(torch.cat(features, 1))


def cat_rewrites(fast: fuser.OptimizedModule, kind: str = "cat_buffer") -> list:
    return [r for r in fast.fusion_report.rewrites if r.kind == kind]


def graph_modules(fast: nn.Module) -> list[torch.fx.GraphModule]:
    return [m for m in fast.modules() if isinstance(m, torch.fx.GraphModule)]


def cat_nodes(fast: nn.Module) -> list[torch.fx.Node]:
    return [n for g in graph_modules(fast) for n in g.graph.nodes if n.target is torch.cat]


@pytest.mark.parametrize("backend", ["torch", "interpret"])
@pytest.mark.parametrize(("model_type", "cats"), [(C2fLike, 1), (DenseLike, 3)], ids=["c2f", "dense"])
def test_blocks_lose_their_cats_and_match_float64(model_type: type[nn.Module], cats: int, backend: str) -> None:
    model = seeded(model_type())
    x = torch.randn(2, model.cv1[0].in_channels if model_type is C2fLike else 5, 11, 9)
    fast = fuser.optimize(model, (x,), backend=backend, precision="ieee")
    rewrites = cat_rewrites(fast)
    assert len(rewrites) == cats, fast.fusion_report
    assert not cat_nodes(fast), "the cat nodes are gone from the graph"
    assert all(r.eliminated for r in rewrites) and "Also fused" in str(fast.fusion_report)
    with torch.no_grad():
        assert_close(fast(x), reference64(model, x), "ieee", f"{model_type.__name__} on {backend}")


def test_the_producers_write_the_buffer_and_nothing_is_copied() -> None:
    """In the interpreter the fused convs' outputs are views of the cat's buffer: cat_result finds every part
    in place (no copy_), and what the next conv reads is the buffer itself."""
    model = seeded(C2fLike())
    x = torch.randn(2, 7, 11, 9)
    fast = fuser.optimize(model, (x,), backend="interpret", precision="ieee")
    (gm,) = graph_modules(fast)
    seen = {}

    def record(module: nn.Module, args: tuple, kwargs: dict, output: torch.Tensor) -> None:
        seen[module.source] = (kwargs.get("out"), output)

    handles = [m.register_forward_hook(record, with_kwargs=True) for m in gm.modules() if isinstance(m, FusedConv2d)]
    copies = []
    original = torch.Tensor.copy_
    try:
        torch.Tensor.copy_ = lambda self, src, *a, **k: copies.append(self.shape) or original(self, src, *a, **k)
        with torch.no_grad():
            y = fast(x)
    finally:
        torch.Tensor.copy_ = original
        for h in handles:
            h.remove()
    assert not copies, f"copies into the buffer: {copies}"
    slots = {name: out for name, (out, _) in seen.items() if out is not None}
    assert set(slots) == {"cv1.0", "m.0.1.0", "m.1.1.0"}, sorted(seen)
    for name, out in slots.items():
        assert seen[name][1].data_ptr() == out.data_ptr(), f"{name} wrote elsewhere"
    buffers = {out.untyped_storage().data_ptr() for out in slots.values()}
    assert len(buffers) == 1, "all producers write one buffer"
    assert_close(y, reference64(model, x), "ieee", "C2f in place")


def test_call_k_is_unchanged_by_call_k_plus_1() -> None:
    """The buffer is new in every forward: a cat result (here the model's output) from one call keeps its
    values after the next."""

    class Widen(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = conv_bn_act(5, 3, 3), conv_bn_act(5, 7)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.cat([self.a(x), x, self.b(x)], 1)

    model = seeded(Widen())
    x1, x2 = torch.randn(2, 5, 9, 7), torch.randn(2, 5, 9, 7)
    fast = fuser.optimize(model, (x1,), backend="interpret", precision="ieee")
    assert len(cat_rewrites(fast)) == 1
    with torch.no_grad():
        y1 = fast(x1)
        kept = y1.clone()
        y2 = fast(x2)
    assert y1.data_ptr() != y2.data_ptr()
    assert torch.equal(y1, kept)
    assert_close(y2, reference64(model, x2), "ieee", "second call")


class Guarded(nn.Module):
    """A cat a fused conv feeds, in a form the pass must leave alone."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.a, self.b = conv_bn_act(5, 3), conv_bn_act(5, 4)

    def forward(self, x: torch.Tensor):
        a, b = self.a(x), self.b(x)
        if self.form == "twice":
            return torch.cat([a, b, a], 1)
        if self.form == "dtype":
            return torch.cat([a, b.double()], 1)
        if self.form == "dim":
            return torch.cat([a, b[:, :3]], 2)
        if self.form == "mutated":  # with a slot of the buffer as a, the write would change y
            y = torch.cat([a, b], 1)
            a.masked_fill_(a > 0.5, 0.5)
            return y * a.mean()
        if self.form == "returned":
            return torch.cat([a, b], 1), a
        raise AssertionError(self.form)


@pytest.mark.parametrize(
    ("form", "reason"),
    [
        ("twice", "feeds it twice"),
        ("dtype", "different dtypes"),
        ("dim", "along dim 2"),
        ("mutated", "writes fused_a_0 in place"),
        ("returned", "returned by the graph"),
    ],
)
def test_guards_keep_the_cat_or_the_part_and_say_why(form: str, reason: str) -> None:
    """A cat the pass must leave alone stays, with the reason in the report; a producer that must not be a
    slot of the buffer (written in place, or returned) is copied in while the others still write it."""
    model = seeded(Guarded(form))
    x = torch.randn(2, 5, 7, 9)
    fast = fuser.optimize(model, (x,), backend="interpret", precision="ieee")
    if form in ("mutated", "returned"):
        (rewrite,) = cat_rewrites(fast)
        assert reason in rewrite.detail and "fused_b_0 -> [3:7]; 1 part(s) copied in" in rewrite.detail
    else:
        assert not cat_rewrites(fast)
        (kept,) = cat_rewrites(fast, "cat_kept")
        assert reason in kept.detail and not kept.eliminated
        assert cat_nodes(fast), "the cat is still there"
    with torch.no_grad():
        got, ref = fast(x), reference64(model, x)
    for g, r in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,), strict=True):
        assert_close(g, r, "ieee", form)


def test_cat_result_copies_only_what_is_not_in_place() -> None:
    buf = torch.randn(2, 9, 5, 3).contiguous(memory_format=torch.channels_last)
    first = buf.narrow(1, 0, 4)
    first.copy_(torch.randn(2, 4, 5, 3))
    other = torch.randn(2, 5, 5, 3)
    expected = torch.cat([first.clone(), other], 1)
    assert cat_result(buf, [first, other], (0, 4)) is buf
    assert torch.equal(buf, expected)
    # parts that do not fit the buffer: torch.cat decides (here: a new tensor; a shape mismatch is its error)
    wide = torch.randn(2, 6, 5, 3)
    assert torch.equal(cat_result(buf, [first, wide], (0, 4)), torch.cat([first, wide], 1))
    with pytest.raises(RuntimeError):
        cat_result(buf, [first, torch.randn(2, 5, 4, 3)], (0, 4))
    assert torch.equal(cat_result(None, [first, other], (0, 4)), expected)


def test_fused_conv_writes_into_out_and_ignores_an_out_that_does_not_fit() -> None:
    w, b = torch.randn(5, 3, 3, 3) / 5, torch.randn(5)
    g = ConvGeometry(padding=(1, 1, 1, 1))
    conv = FusedConv2d(w, b, stride=g.stride, padding=g.padding, dilation=g.dilation, groups=1,
                       epilogue=Epilogue(Activation.SILU), precision="ieee", backend="interpret")  # fmt: skip
    x = torch.randn(2, 3, 7, 9)
    ref = torch.nn.functional.silu(torch.nn.functional.conv2d(x.double(), w.double(), b.double(), padding=1))
    buf = torch.full((2, 7, 9, 11), float("nan")).permute(0, 3, 1, 2)
    with torch.no_grad():
        y = conv(x, out=buf[:, 2:7])
        assert y.data_ptr() == buf[:, 2:7].data_ptr()
        assert_close(buf[:, 2:7], ref, "ieee", "into out")
        assert torch.isnan(buf[:, :2]).all() and torch.isnan(buf[:, 7:]).all()
        wrong = torch.empty(2, 5, 7, 9)  # NCHW: channels not contiguous
        y = conv(x, out=wrong)
        assert y.data_ptr() != wrong.data_ptr()
        assert_close(y, ref, "ieee", "out ignored")


class OpLog(TorchDispatchMode):
    """Counts the aten ops run inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize(
    ("c_in", "k", "groups"),
    [(3, 3, 1), (19, 3, 1), (5, 3, 1), (7, 3, 1), (19, 1, 1), (6, 3, 6)],
    ids=["direct", "channel_blocks", "flat_k", "filter_rows", "gemm_1x1", "depthwise"],
)
def test_kernels_read_a_channel_slice_without_a_copy(c_in: int, k: int, groups: int) -> None:
    """A slot of a cat buffer as a conv's input: every kernel path reads it where it lies. The aten ops of
    the call are those of a call on a dense NHWC input (the interpreter's own host copies included)."""
    c_out = 6 if groups > 1 else 5
    w, b = torch.randn(c_out, c_in // groups, k, k) / (c_in * k), torch.randn(c_out)
    conv = FusedConv2d(w, b, stride=(1, 1), padding=(k // 2,) * 4, dilation=(1, 1), groups=groups,
                       epilogue=Epilogue(Activation.SILU), precision="ieee", backend="interpret")  # fmt: skip
    dense = torch.randn(2, 9, 11, c_in).permute(0, 3, 1, 2)
    sliced = torch.randn(2, 9, 11, c_in + 7).permute(0, 3, 1, 2)[:, 4 : 4 + c_in]
    logged = []
    for x in (dense, sliced):
        with torch.no_grad():
            conv(x)  # builds the call
            with OpLog() as log:
                y = conv(x)
        logged.append(log.ops)
        ref = torch.nn.functional.conv2d(x.double(), w.double(), b.double(), padding=k // 2, groups=groups)
        assert_close(y, torch.nn.functional.silu(ref), "ieee", f"x strides {x.stride()}")
    assert logged[0] == logged[1]


def test_torch_compile_is_one_frame_and_equal() -> None:
    model = seeded(C2fLike())
    x = torch.randn(2, 7, 11, 9)
    fast = fuser.optimize(model, (x,), backend="interpret", precision="ieee")
    assert cat_rewrites(fast)
    with torch.no_grad():
        eager = fast(x)
    torch._dynamo.reset()
    counters.clear()
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(fast, backend=counter)
    with torch.no_grad():
        for _ in range(3):
            out = compiled(x)
    assert counter.frame_count == 1, f"{counter.frame_count} frames"
    assert not dict(counters["graph_break"])
    cats = [n for g in counter.graphs for n in g.graph.nodes if n.target is torch.cat]
    assert len(cats) == 1, "the compiler sees a plain torch.cat"
    assert_close(out, eager, "ieee", "compiled vs eager")


def test_onnx_export_is_a_plain_concat_and_matches_onnxruntime(tmp_path) -> None:
    model = seeded(DenseLike())
    x = torch.randn(2, 5, 11, 9)
    fast = fuser.optimize(model, (x,), backend="interpret", precision="ieee")
    assert cat_rewrites(fast)
    path = fuser.export_onnx(fast, (x,), tmp_path / "dense.onnx")
    ops = [n.op_type for n in onnx.load(str(path)).graph.node]
    assert ops.count("Concat") == 3
    session = ort.InferenceSession(str(path))
    (out,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    assert_close(torch.from_numpy(out), reference64(model, x), "ieee", "onnxruntime")


def test_every_cat_of_yolov8n_backbone_and_neck_is_eliminated() -> None:
    """The backbone and neck are one graph (the head is a leaf): each C2f's cat and the neck's two Concats
    of a conv output with an earlier level get buffers; the two after an upsample are virtual inputs."""
    model = models.build("yolov8n", calibration_batch=2, calibration_size=32)
    x = models.example_input("yolov8n", batch=1, size=(64, 32), seed=1)
    fast = fuser.optimize(model, (x,), backend="torch")
    c2f = [name for name, m in model.named_modules() if type(m).__name__ == "C2f"]
    assert len(c2f) == 8
    assert sorted(r.location for r in cat_rewrites(fast)) == sorted([*c2f, "model.17", "model.20"])
    assert all(len(r.eliminated) == 1 and r.eliminated[0].startswith("cat") for r in cat_rewrites(fast))
    virtual = [r.location for r in fast.fusion_report.rewrites if r.kind == "virtual_cat"]
    assert virtual == ["model.11", "model.14"], str(fast.fusion_report)
    with torch.no_grad():
        assert_close(fast(x)[0], reference64(model, x)[0], "tf32", "yolov8n")


@pytest.mark.gpu
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["launches", "cuda_graphs"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("model_type", [C2fLike, DenseLike])
def test_compiled_kernels_write_the_buffer(model_type: type[nn.Module], dtype: torch.dtype, cuda_graphs: bool) -> None:
    model = seeded(model_type()).cuda().to(dtype)
    x = torch.randn(3, 7 if model_type is C2fLike else 5, 13, 11, device="cuda", dtype=dtype)
    fast = fuser.optimize(model, (x,), precision="ieee", cuda_graphs=cuda_graphs)
    assert cat_rewrites(fast) and not cat_nodes(fast)
    with torch.no_grad():
        y1 = fast(x)
        kept = y1.clone()
        y2 = fast(torch.randn_like(x))
    assert torch.equal(y1, kept) and y1.data_ptr() != y2.data_ptr()
    assert_close(y1, reference64(model.float().cpu(), x.float().cpu()), "fp16" if dtype == torch.float16 else "ieee")
