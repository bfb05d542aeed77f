"""The plain-torch NMS behind the torchvision shim keeps what greedy NMS keeps."""

from __future__ import annotations

import pytest
import torch
from torchvision_shim import nms


def test_nms_keeps_the_best_of_each_overlapping_group_in_score_order():
    boxes = torch.tensor(
        [
            [0.0, 0.0, 10.0, 10.0],
            [1.0, 1.0, 11.0, 11.0],  # IoU 0.68 with box 0, lower score: suppressed
            [20.0, 20.0, 30.0, 30.0],
            [20.0, 25.0, 30.0, 35.0],  # IoU 0.33 with box 2: kept at threshold 0.5
            [50.0, 50.0, 53.0, 57.0],
        ]
    )
    scores = torch.tensor([0.9, 0.95, 0.3, 0.6, 0.1])
    assert nms(boxes, scores, 0.5).tolist() == [1, 3, 2, 4]
    assert nms(boxes, scores, 0.3).tolist() == [1, 3, 4]
    assert nms(boxes[:0], scores[:0], 0.5).numel() == 0


def test_torchvision_ops_nms_runs():
    torchvision = pytest.importorskip("torchvision", reason="the zoo's libraries are not installed (make test does)")

    boxes = torch.rand(37, 4) * 20
    boxes[:, 2:] += boxes[:, :2] + 1
    scores = torch.rand(37)
    assert torch.equal(torchvision.ops.nms(boxes, scores, 0.4), nms(boxes, scores, 0.4))
