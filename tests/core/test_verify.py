"""fuser.verify: the output checks, the per-layer table, and naming the layer that was broken on purpose."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch
from accuracy import rel_error
from torch import nn
from toy_models import ConvBnAct, seeded

import fuser
from fuser import models
from fuser.lower.fused_modules import FusedConv2d
from fuser.verification import TOLERANCE, box_agreement, detections, output_error, top1_agreement


@pytest.fixture(scope="module")
def resnet() -> tuple[nn.Module, torch.Tensor, nn.Module]:
    """resnet26, an input, and the model optimized (ieee, torch backend); tests that break it take a copy."""
    model, x = models.build("resnet26"), torch.randn(1, 3, 29, 27, generator=torch.Generator().manual_seed(3))
    return model, x, fuser.optimize(model, (x,), precision="ieee", backend="torch")


def _fused(optimized: nn.Module) -> list[tuple[str, FusedConv2d]]:
    return [(n, m) for n, m in optimized.named_modules() if isinstance(m, FusedConv2d)]


def test_tolerance_table_is_the_tests_table():
    import accuracy

    assert accuracy.TOLERANCE is TOLERANCE
    assert TOLERANCE["ieee"] == 1e-5 and TOLERANCE["tf32"] == 2e-3 and TOLERANCE["bf16"] == 2e-2


def test_unbroken_model_passes_with_every_layer_compared(resnet):
    model, x, optimized = resnet
    result = fuser.verify(model, optimized, (x,))
    assert result.ok, str(result)
    assert result.budget == TOLERANCE["ieee"]
    assert result.first_bad_layer is None
    assert len(result.layers) == len(optimized.fusion_report.fused) == 29  # each fused module runs once here
    assert all(c.rel_error < 1e-5 and c.cosine > 1 - 1e-9 for c in result.layers), str(result)
    assert result.top1_agreement == 1.0
    assert result.cosine > 1 - 1e-10
    text = str(result)
    assert "OK" in text and "layer1" in text


def test_planted_fault_in_one_fused_layer_is_named(resnet):
    model, x, optimized = resnet
    optimized = copy.deepcopy(optimized)
    fused = _fused(optimized)
    victim_name, victim = fused[len(fused) // 2]
    with torch.no_grad():
        victim.bias += 0.5 * victim.bias.abs().mean() + 0.1  # a folding bug: the folded bias is off
    result = fuser.verify(model, optimized, (x,))
    assert not result.ok, str(result)
    bad = result.first_bad_layer
    assert bad is not None and bad.name == victim_name, str(result)
    assert bad.source.startswith(victim.source.rsplit(".", 1)[0]), str(result)
    assert all(c.rel_error < 1e-5 for c in result.layers[: bad.index - 1]), str(result)
    assert bad.own_error < 1e-6  # the kernel does what its parameters say: the fusion is to blame
    assert "folded parameters" in result.blame() and victim_name in str(result)
    assert result.to_dict()["first_bad_layer"]["name"] == victim_name


def test_planted_fault_under_a_loose_budget_passes_and_a_tight_one_fails(resnet):
    model, x, optimized = resnet
    optimized = copy.deepcopy(optimized)
    _, victim = _fused(optimized)[-1]
    with torch.no_grad():
        victim.weight.mul_(1.001)
    loose = fuser.verify(model, optimized, (x,), budget=0.5)
    assert loose.ok and loose.first_bad_layer is None
    tight = fuser.verify(model, optimized, (x,), budget=1e-6)
    assert not tight.ok and tight.first_bad_layer is not None


def test_bf16_kernels_are_within_their_budget_and_blamed_on_precision_when_the_budget_is_tight():
    model = seeded(nn.Sequential(ConvBnAct(nn.SiLU(), 5, 7), ConvBnAct(nn.ReLU(), 7, 9, stride=2)))
    x = torch.randn(2, 5, 13, 11)
    optimized = fuser.optimize(model, (x,), precision="bf16", backend="interpret")
    result = fuser.verify(model, optimized, (x,))
    assert result.ok and result.budget == TOLERANCE["bf16"], str(result)
    strict = fuser.verify(model, optimized, (x,), budget=1e-5)
    assert not strict.ok
    assert strict.first_bad_layer.index == 1 and "precision (bf16)" in strict.blame(), str(strict)


def test_neither_model_is_changed(resnet):
    model, x, optimized = resnet
    before = {k: v.clone() for k, v in model.state_dict().items()}
    before_opt = {k: v.clone() for k, v in optimized.state_dict().items()}
    fuser.verify(model, optimized, (x,))
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    assert all(torch.equal(v, optimized.state_dict()[k]) for k, v in before_opt.items())
    assert next(model.parameters()).dtype == torch.float32
    assert not any(m._forward_hooks for m in optimized.modules())


def test_partly_traced_detector_layers_are_compared():
    model, x = models.build("yolov8n"), torch.randn(1, 3, 64, 96)
    optimized = fuser.optimize(model, (x,), precision="ieee", backend="torch")
    result = fuser.verify(model, optimized, (x,))
    assert result.ok, str(result)
    assert len(result.layers) >= len(optimized.fusion_report.fused) - 1, str(result)
    assert not any(math.isnan(c.rel_error) for c in result.layers), str(result)


def test_output_error_over_a_pytree():
    ref = {"a": torch.randn(3, 5, dtype=torch.float64), "b": [torch.randn(7, dtype=torch.float64)]}
    out = {"a": ref["a"].float(), "b": [ref["b"][0] * 1.01]}
    error, cosine, notes = output_error(out, ref)
    expected = (0.01 * ref["b"][0].norm() / torch.cat([ref["a"].flatten(), ref["b"][0]]).norm()).item()
    assert error == pytest.approx(expected, rel=1e-3) and cosine > 0.9999 and not notes
    out["a"] = out["a"].clone()
    out["a"][0, 0] = float("nan")
    assert output_error(out, ref)[0] == math.inf


def test_top1_agreement():
    ref = torch.tensor([[0.0, 1.0, 2.0], [3.0, 1.0, 0.0], [0.0, 5.0, 1.0]])
    out = ref.clone()
    out[2] = torch.tensor([6.0, 5.0, 1.0])
    assert top1_agreement(out, ref) == pytest.approx(2 / 3)
    assert top1_agreement(torch.randn(2, 3, 4), torch.randn(2, 3, 4)) is None


def _yolo_prediction(boxes_xywh: torch.Tensor, classes: torch.Tensor, n_classes: int, anchors: int) -> torch.Tensor:
    pred = torch.zeros(1, 4 + n_classes, anchors)
    pred[0, :4] = torch.rand(4, anchors) * 10 + 5
    pred[0, 4:] = torch.rand(n_classes, anchors) * 0.1
    for i, (box, c) in enumerate(zip(boxes_xywh, classes, strict=True)):
        pred[0, :4, i] = box
        pred[0, 4 + c, i] = 0.9
    return pred


def test_yolo_style_boxes_are_decoded_and_matched_by_class_and_iou():
    boxes = torch.tensor([[20.0, 20.0, 10.0, 10.0], [50.0, 40.0, 8.0, 12.0], [70.0, 70.0, 6.0, 6.0]])
    ref = _yolo_prediction(boxes, torch.tensor([1, 2, 0]), 3, 37)
    found = detections(ref)
    assert len(found) == 1 and len(found[0].scores) == 3
    assert torch.allclose(found[0].boxes[0], torch.tensor([15.0, 15.0, 25.0, 25.0]))
    assert box_agreement(ref.clone(), ref) == 1.0
    moved = boxes.clone()
    moved[1, 0] += 20  # no overlap any more
    wrong_class = _yolo_prediction(moved, torch.tensor([1, 2, 2]), 3, 37)
    assert box_agreement(wrong_class, ref) == pytest.approx(1 / 3)


def test_torchvision_style_detections_are_matched():
    ref = [
        {
            "boxes": torch.tensor([[0.0, 0, 10, 10], [20, 20, 30, 35]]),
            "labels": torch.tensor([3, 1]),
            "scores": torch.tensor([0.9, 0.8]),
        }
    ]
    shifted = [{"boxes": ref[0]["boxes"] + 1, "labels": torch.tensor([3, 2]), "scores": torch.tensor([0.9, 0.8])}]
    assert box_agreement(shifted, ref) == pytest.approx(0.5)
    assert detections(torch.randn(3, 5)) is None


def test_plot_is_written(resnet, tmp_path: Path):
    pytest.importorskip("matplotlib", reason="the plot needs the optional dependency matplotlib (fuser[plot])")
    model, x, optimized = resnet
    path = fuser.verify(model, optimized, (x,)).plot(tmp_path / "errors.png")
    assert path.stat().st_size > 1000


def test_a_wrong_model_is_caught_without_a_report(resnet):
    model, x, _ = resnet
    other = models.build("resnet26", seed=1)
    result = fuser.verify(model, other, (x,))
    assert not result.ok and result.layers == [] and rel_error(other(x), model(x)) > 0.1
    assert "no fusion_report" in str(result)


def test_command_line_verify(capsys, tmp_path: Path):
    from fuser import cli

    argv = ["verify", "resnet26", "--input-shape", "1,3,35,33", "--precision", "ieee", "--device", "cpu"]
    assert cli.main([*argv, "--backend", "torch"]) == 0
    out = capsys.readouterr().out
    assert "fuser.verify: OK" in out and "Fused layers" in out
    assert cli.main([*argv, "--backend", "torch", "--budget", "1e-12"]) == 1
    assert "FAILED" in capsys.readouterr().out
