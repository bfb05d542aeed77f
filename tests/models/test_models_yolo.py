"""The YOLOv8 detector: built from its layer list, routed by .f, not traceable as a whole by design."""

from __future__ import annotations

import copy

import pytest
import torch
from accuracy import rel_error
from models_cases import CHEAP_KWARGS, built, input_for
from models_walk import traced_units
from torch import fx, nn

from fuser.models import build, example_input
from fuser.models.yolo import YOLOV8, C2f, Concat, Conv, Detect, parse_model


def test_layers_follow_the_layer_list() -> None:
    model = built("yolov8n")
    rows = YOLOV8["backbone"] + YOLOV8["head"]
    assert len(model.model) == len(rows)
    for i, (m, (f, _, name, _)) in enumerate(zip(model.model, rows, strict=True)):
        assert (m.i, m.f, m.type) == (i, f, name)
    # The outputs read by later layers: 4 and 6 (backbone P3, P4), 9 (SPPF), 12, 15, 18, 21 (neck).
    assert model.save == [4, 6, 9, 12, 15, 18, 21]
    assert model.model[-1].stride == (8.0, 16.0, 32.0)


def test_scales_set_depth_and_width() -> None:
    n, s = built("yolov8n"), built("yolov8s")
    assert n.model[0].conv.out_channels == 16 and s.model[0].conv.out_channels == 32  # 64 * 0.25, 64 * 0.5
    assert n.model[9].cv2.conv.out_channels == 256 and s.model[9].cv2.conv.out_channels == 512
    assert [len(m.m) for m in n.model if isinstance(m, C2f)] == [1, 2, 2, 1, 1, 1, 1, 1]  # round(n * 0.33)


def test_whole_model_does_not_trace_because_detect_compares_shapes() -> None:
    model = built("yolov8n")
    with pytest.raises(fx.proxy.TraceError, match="control flow"):
        fx.symbolic_trace(model)
    with pytest.raises(fx.proxy.TraceError, match="control flow"):
        fx.symbolic_trace(model.model[-1])


def test_every_backbone_and_neck_block_traces_and_runs_the_same() -> None:
    model = built("yolov8n")
    x = input_for("yolov8n")
    outputs: list[torch.Tensor | None] = []
    with torch.no_grad():
        for m in model.model[:-1]:
            if m.f != -1:
                x = outputs[m.f] if isinstance(m.f, int) else [x if j == -1 else outputs[j] for j in m.f]
            traced = fx.symbolic_trace(m)
            y = m(x)
            assert torch.equal(traced(x), y), f"layer {m.i} ({m.type}) traced differs from eager"
            outputs.append(y)
            x = y


def test_largest_traceable_units_are_the_blocks_and_the_head_branches() -> None:
    units, failed = traced_units(built("yolov8n"))
    assert failed == ["", "model.", "model.22.", "model.22.cv2.", "model.22.cv3."]
    paths = [p for p, _ in units]
    assert paths[:22] == [f"model.{i}." for i in range(22)]
    assert sorted(paths[22:]) == sorted([f"model.22.cv{b}.{i}." for b in (2, 3) for i in range(3)] + ["model.22.dfl."])


def test_expected_fusions_by_the_architecture() -> None:
    # Counted here from the layer objects, a third way: 1 per Conv block, 2 per C2f plus 2 per
    # Bottleneck, 2 per SPPF, 2 Convs in each of Detect's 2 x 3 branches, and each branch's last 1x1
    # conv (bias, nothing after it: a lone conv). The DFL conv has no bias and is not one.
    model = built("yolov8n")
    conv_blocks = sum(isinstance(m, Conv) for m in model.modules())
    detect = model.model[-1]
    assert model.expected_fusions == conv_blocks + 2 * detect.nl
    assert sum(isinstance(m, Conv) for m in detect.modules()) == 2 * 2 * detect.nl
    assert detect.dfl.conv.bias is None


def test_input_size_must_be_a_multiple_of_32() -> None:
    with pytest.raises(ValueError, match=r"multiples of 32.*\(1, 3, 64, 80\)"):
        built("yolov8n")(torch.randn(1, 3, 64, 80))


def test_anchor_cache_follows_shape_dtype_and_device_changes() -> None:
    model = copy.deepcopy(built("yolov8n"))
    small, large = input_for("yolov8n", batch=1), example_input("yolov8n", size=(96, 128), seed=3)
    with torch.no_grad():
        fresh = copy.deepcopy(model)(large)
        model(small)
        assert torch.equal(model(large), fresh), "anchors of the previous shape were reused"
        model64 = model.double()
        y64 = model64(large.double())
    assert y64.dtype == torch.float64 and model64.model[-1].anchors.dtype == torch.float64
    assert rel_error(fresh, y64) < 1e-5


def test_box_decoding_against_a_direct_computation() -> None:
    # DFL is the expectation of a softmax over reg_max bins; boxes are (centre, size) * stride.
    # Written independently (no make_anchors, dist2bbox or DFL conv), in float64.
    model = built("yolov8n")
    detect = model.model[-1]
    x = input_for("yolov8n", batch=1)
    captured: dict[str, list[torch.Tensor]] = {}
    hook = detect.register_forward_pre_hook(lambda m, args: captured.setdefault("feats", list(args[0])))
    with torch.no_grad():
        y = model(x)
        hook.remove()
        raw = [
            torch.cat((detect.cv2[i](f), detect.cv3[i](f)), 1).flatten(2).double()
            for i, f in enumerate(captured["feats"])
        ]
    boxes, centres, strides = [], [], []
    for level, (r, s) in enumerate(zip(raw, detect.stride, strict=True)):
        h, w = captured["feats"][level].shape[-2:]
        bins = r[:, : 4 * detect.reg_max].view(1, 4, detect.reg_max, -1).softmax(2)
        boxes.append((bins * torch.arange(detect.reg_max, dtype=torch.float64).view(1, 1, -1, 1)).sum(2))
        gy, gx = torch.meshgrid(torch.arange(h) + 0.5, torch.arange(w) + 0.5, indexing="ij")
        centres.append(torch.stack((gx.flatten(), gy.flatten())).double())
        strides.append(torch.full((h * w,), s, dtype=torch.float64))
    dist, centre, stride = torch.cat(boxes, 2), torch.cat(centres, 1), torch.cat(strides)
    left_top, right_bottom = dist[:, :2], dist[:, 2:]
    expected_xy = (centre + (right_bottom - left_top) / 2) * stride
    expected_wh = (left_top + right_bottom) * stride
    scores = torch.cat([r[:, 4 * detect.reg_max :] for r in raw], 2).sigmoid()
    # The reference decodes the head's float32 outputs in float64.
    assert rel_error(y[:, :2], expected_xy) < 1e-6
    assert rel_error(y[:, 2:4], expected_wh) < 1e-6
    assert rel_error(y[:, 4:], scores) < 1e-6


def test_unknown_module_or_scale_is_named() -> None:
    cfg = {**YOLOV8, "head": [*YOLOV8["head"][:-1], [[15, 18, 21], 1, "Segment", ["nc"]]]}
    with pytest.raises(KeyError, match="layer 22: unknown module 'Segment'"):
        parse_model(cfg, "n", 80)
    with pytest.raises(KeyError, match="unknown YOLOv8 scale 'q'"):
        build("yolov8n", scale="q")


def test_other_class_counts() -> None:
    model = build("yolov8n", nc=3, **CHEAP_KWARGS["yolov8n"])
    with torch.no_grad():
        y = model(input_for("yolov8n", batch=1))
    assert y.shape[1] == 4 + 3
    assert isinstance(model.model[-1], Detect) and isinstance(model.model[11], Concat)
    assert isinstance(model.model[10], nn.Upsample)
