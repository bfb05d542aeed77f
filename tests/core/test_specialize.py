"""Forwards that read their input's sizes as numbers, traced for the example's sizes (fuser.capture.specialize).

The two replicas copy how real libraries compute TensorFlow's "same" padding at run time: timm's Conv2dSame
(``pad_same``: ``math.ceil`` and ``max`` on ``x.size()``) and transformers' MobileNetV2ConvLayer with
``tf_padding`` (``int(features.shape[-2])``). torch.fx cannot trace either; with example inputs fuser traces
them for the example's sizes, runs that graph for any batch of those sizes and the original model otherwise.
"""

from __future__ import annotations

import copy
import io
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from accuracy import assert_close, reference64
from torch import nn
from toy_models import ConvBnAct, seeded

import fuser
from fuser.capture.specialize import ShapeGuard, make_shape_tracer
from fuser.capture.tracing import _trace, capture


class TimmConv2dSame(nn.Conv2d):
    """timm.layers.Conv2dSame: "same" padding computed from the input's size in the forward."""

    def __init__(self, c_in: int, c_out: int, k: int, stride: int) -> None:
        super().__init__(c_in, c_out, k, stride, padding=0, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ih, iw = x.size()[-2:]
        pads = []
        for size, k, s, d in zip((ih, iw), self.kernel_size, self.stride, self.dilation, strict=True):
            pads.append(max((math.ceil(size / s) - 1) * s + (k - 1) * d + 1 - size, 0))
        pad_h, pad_w = pads
        x = F.pad(x, [pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2])
        return F.conv2d(x, self.weight, self.bias, self.stride, (0, 0), self.dilation, self.groups)


class HfTfPaddingConvLayer(nn.Module):
    """transformers' MobileNetV2ConvLayer with ``config.tf_padding``: pad, conv, BN, ReLU6."""

    def __init__(self, c_in: int, c_out: int, k: int, stride: int, groups: int = 1) -> None:
        super().__init__()
        self.convolution = nn.Conv2d(c_in, c_out, k, stride, padding=0, groups=groups, bias=False)
        self.normalization = nn.BatchNorm2d(c_out)
        self.activation = nn.ReLU6()

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        in_height, in_width = int(features.shape[-2]), int(features.shape[-1])
        (stride_h, stride_w), (k_h, k_w) = self.convolution.stride, self.convolution.kernel_size
        pad_h = max(k_h - (stride_h if in_height % stride_h == 0 else in_height % stride_h), 0)
        pad_w = max(k_w - (stride_w if in_width % stride_w == 0 else in_width % stride_w), 0)
        features = F.pad(features, (pad_w // 2, pad_w - pad_w // 2, pad_h // 2, pad_h - pad_h // 2))
        return self.activation(self.normalization(self.convolution(features)))


class TfPaddedNet(nn.Module):
    """A stem as timm's tf_* models build it (Conv2dSame, then BN and SiLU in the parent), two tf_padding
    layers as transformers' MobileNetV2 builds them, a 1x1 conv block and a classifier."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_stem = TimmConv2dSame(3, 8, 3, 2)
        self.bn1 = nn.BatchNorm2d(8)
        self.act1 = nn.SiLU()
        self.depthwise = HfTfPaddingConvLayer(8, 8, 3, 2, groups=8)
        self.pointwise = HfTfPaddingConvLayer(8, 12, 1, 1)
        self.head = ConvBnAct(nn.ReLU(), 12, 10, kernel_size=1, padding=0)
        self.fc = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.act1(self.bn1(self.conv_stem(x)))
        x = self.head(self.pointwise(self.depthwise(x)))
        return self.fc(x.mean((2, 3)))


def _model() -> nn.Module:
    return seeded(TfPaddedNet())


X = (3, 3, 21, 19)  # odd sizes: both "same" paddings are then asymmetric


def test_without_example_sizes_the_size_reading_forwards_are_not_traced():
    untraced = {u.type_name for u in capture(_model()).untraced}
    assert untraced == {"TimmConv2dSame", "HfTfPaddingConvLayer"}


def test_size_reading_convs_fuse_when_traced_for_the_example_sizes():
    model, x = _model(), torch.randn(*X)
    opt = fuser.optimize(model, (x,), backend="torch")
    report = opt.fusion_report
    assert report.specialized == "(*, 3, 21, 19)"
    assert "Traced for inputs of shape (*, 3, 21, 19)" in str(report)
    assert report.untraced == []
    fused = {e.location: e.ops for e in report.fused}
    assert fused["conv_stem, bn1, act1"] == ["conv2d", "batch_norm", "silu"], str(report)
    assert fused["depthwise.{convolution,normalization,activation}"] == ["conv2d", "batch_norm", "relu6"]
    assert fused["pointwise.{convolution,normalization,activation}"] == ["conv2d", "batch_norm", "relu6"]
    assert isinstance(opt.module, ShapeGuard)
    with torch.no_grad():
        assert_close(opt(x), reference64(model, x), "ieee", "the example's shape")


def test_another_batch_of_the_same_size_runs_the_graph_without_a_warning():
    model = _model()
    opt = fuser.optimize(model, (torch.randn(*X),), backend="torch")
    x = torch.randn(5, *X[1:])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            out = opt(x)
    assert_close(out, reference64(model, x), "ieee", "batch 5")
    assert opt.module._placed == {}  # the original was never needed


def test_another_image_size_runs_the_original_with_one_warning():
    model = _model()
    opt = fuser.optimize(model, (torch.randn(*X),), backend="torch")
    x = torch.randn(2, 3, 17, 23)
    warning = r"optimized for inputs of shape \(\*, 3, 21, 19\).*\(2, 3, 17, 23\)"
    with pytest.warns(RuntimeWarning, match=warning), torch.no_grad():
        out = opt(x)
    assert_close(out, reference64(model, x), "ieee", "17 x 23")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per shape
        with torch.no_grad():
            opt(x)
    with pytest.warns(RuntimeWarning, match="keyword arguments"), torch.no_grad():
        opt(x=torch.randn(*X))


def test_the_original_follows_the_optimized_models_dtype_and_stays_out_of_its_state():
    model = _model()
    opt = fuser.optimize(model, (torch.randn(*X),), backend="torch")
    numel = lambda m: sum(t.numel() for t in m.state_dict().values())
    assert numel(opt) <= numel(model)  # the original's copy is not in the state dict
    opt.double()
    x = torch.randn(2, 3, 17, 23, dtype=torch.float64)
    with pytest.warns(RuntimeWarning), torch.no_grad():
        out = opt(x)
    assert out.dtype == torch.float64
    assert_close(out, reference64(model, x), "ieee", "float64 after .double()")


def test_a_specialized_model_survives_save_and_load():
    model = _model()
    opt = fuser.optimize(model, (torch.randn(*X),), backend="torch")
    buffer = io.BytesIO()
    torch.save(opt, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for shape in (X, (2, 3, 17, 23)):
        x = torch.randn(*shape)
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            assert torch.equal(loaded(x), opt(x)), shape


def test_the_users_model_is_untouched():
    model = _model()
    state = copy.deepcopy(model.state_dict())
    attributes = {name: dict(m.__dict__) for name, m in model.named_modules()}
    fuser.optimize(model, (torch.randn(*X),), backend="torch")
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert {name: set(m.__dict__) for name, m in model.named_modules()} == {n: set(a) for n, a in attributes.items()}


@pytest.mark.gpu
def test_on_the_gpu_the_specialized_graph_is_replayed_and_other_sizes_run_the_original():
    model = _model().cuda()
    opt = fuser.optimize(model, (torch.randn(*X, device="cuda"),), backend="triton")  # tf32, CUDA graphs on
    assert isinstance(opt.module, ShapeGuard)
    with torch.no_grad():
        for batch in (3, 5):
            x = torch.randn(batch, *X[1:], device="cuda")
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                assert_close(opt(x), reference64(model, x), "tf32", f"batch {batch}")
        assert len(opt.replay._recorded) == 2 and opt.module._placed == {}
        other = torch.randn(2, 3, 17, 23, device="cuda")
        with pytest.warns(RuntimeWarning, match=r"optimized for inputs of shape \(\*, 3, 21, 19\)"):
            out = opt(other)  # the warm-up runs place the original on the GPU, outside the recording
        assert_close(out, reference64(model, other), "tf32", "17 x 23 on the original")
        assert_close(opt(other), out, "ieee", "its replay")
        assert list(opt.module._placed) == [(torch.device("cuda", 0), torch.float32)]


class BranchOnValues(nn.Module):
    """Branches on its input's values: no example sizes make that traceable."""

    def __init__(self) -> None:
        super().__init__()
        self.block = ConvBnAct(nn.SiLU(), 3, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return y if x.mean() > 0 else -y


def test_a_branch_on_values_is_not_specialized():
    model = seeded(BranchOnValues())
    x = torch.randn(*X) + 1
    opt = fuser.optimize(model, (x,), backend="torch")
    assert opt.fusion_report.specialized == ""
    assert [u.type_name for u in opt.fusion_report.untraced] == ["BranchOnValues"]
    assert [e.location for e in opt.fusion_report.fused] == ["block.{conv,bn,act}"]
    for sign in (1, -1):
        with torch.no_grad():
            assert_close(opt(sign * x), reference64(model, sign * x), "ieee", f"sign {sign}")


class BatchReading(nn.Module):
    """A forward whose graph would hold the batch: a tensor of the batch's size made from a size read."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = TimmConv2dSame(3, 6, 3, 1)
        self.bn = nn.BatchNorm2d(6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        per_image = torch.arange(1, int(x.shape[0]) + 1, dtype=x.dtype).reshape(-1, 1, 1, 1)
        return torch.relu(self.bn(self.conv(x))) * per_image


def test_a_graph_that_would_hold_the_batch_is_not_specialized():
    model = seeded(BatchReading())
    x = torch.randn(*X)
    opt = fuser.optimize(model, (x,), backend="torch")
    assert opt.fusion_report.specialized == ""  # traced at batch 3 and 4, the constants differ
    x5 = torch.randn(5, *X[1:])
    with torch.no_grad():
        assert_close(opt(x5), reference64(model, x5), "ieee", "batch 5")


class SizeReads(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert x.dim() == 4 and x.ndim == 4
        c, (h, w) = x.size(1), x.shape[-2:]
        assert isinstance(c, int) and isinstance(h, int) and isinstance(w, int)
        per_image = x.sum((1, 2, 3)) * (c * h * w)
        return per_image.reshape(x.shape[0], 1) + x.numel()


class BatchLength(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * len(x)


def test_size_reads_are_numbers_and_the_batch_stays_traced():
    gm = _trace(make_shape_tracer((torch.randn(2, 3, 5, 7),))("", frozenset()), SizeReads())
    sizes = [n.args[1:] for n in gm.graph.nodes if n.op == "call_method" and n.target == "size"]
    assert sizes == [(0,)], gm.code  # the batch; C, H and W are constants
    assert "numel" in [n.target for n in gm.graph.nodes]  # it counts the batch too
    assert "fuser_example_value" not in str([n.meta for n in gm.graph.nodes])
    for batch in (2, 5):
        x = torch.randn(batch, 3, 5, 7)
        assert torch.equal(gm(x), SizeReads()(x)), batch
    with pytest.raises(RuntimeError, match="'len' is not supported"):  # an int of the batch: not traceable
        _trace(make_shape_tracer((torch.randn(2, 3),))("", frozenset()), BatchLength())


def test_verify_compares_the_layers_of_a_specialized_graph():
    model, x = _model(), torch.randn(*X)
    opt = fuser.optimize(model, (x,), backend="torch")
    result = fuser.verify(model, opt, (x,))
    assert result.ok and not result.notes, str(result)
    assert len(result.layers) == 4, str(result)


class SequenceModel(nn.Module):
    """Token ids in, a size read of the sequence length (as text models build position ids): its length
    changes from call to call, so it is not worth a graph tied to the example's."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 12)
        self.fc = nn.Linear(12, 7)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(int(ids.shape[1])) * 0.01
        return F.gelu(self.fc(self.embed(ids) + positions[None, :, None]))


def test_a_sequence_model_keeps_the_symbolic_capture():
    model = seeded(SequenceModel())
    ids = torch.randint(0, 50, (2, 11))
    opt = fuser.optimize(model, (ids,), backend="torch")
    assert opt.fusion_report.specialized == ""
    assert [u.path for u in opt.fusion_report.untraced] == ["(model)"]  # as before: its int() is not traced
    other = torch.randint(0, 50, (3, 5))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")
        assert_close(opt(other), reference64(model, other), "ieee", "another length")
