"""Real data: a small Conv-BN-SiLU classifier trained on scikit-learn's bundled handwritten digits.

Random weights hide what users care about: whether a trained model still gives the same labels. The
digits (8x8 grey images, 10 classes, shipped inside scikit-learn: no download) train in a few seconds to
well above chance; then the optimized model's test accuracy must equal the original's, and its labels
agree with the original's on at least 99.5% of the test images, at every precision.
"""

from __future__ import annotations

import copy

import pytest
import torch
from accuracy import TOLERANCE
from torch import nn

import fuser

sklearn_datasets = pytest.importorskip(
    "sklearn.datasets", reason="scikit-learn (a test dependency: pip install -e '.[test]') ships the digits"
)

PRECISIONS = ["ieee", "tf32x3", "tf32", "bf16", "fp16"]
MIN_AGREEMENT = 0.995


def _block(c_in: int, c_out: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm2d(c_out), nn.SiLU())


class DigitsNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(_block(1, 13), _block(13, 27, stride=2), _block(27, 29))
        self.head = nn.Linear(29, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean((2, 3)))


@pytest.fixture(scope="module")
def trained() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """The trained model (eval mode), the test images and their labels."""
    digits = sklearn_datasets.load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target)
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(len(labels), generator=g)
    test, train = order[:397], order[397:]
    torch.manual_seed(0)
    model = DigitsNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small batches: two threads contend more than they share
    try:
        for _ in range(40):
            for batch in train[torch.randperm(len(train), generator=g)].split(48):
                optimizer.zero_grad()
                nn.functional.cross_entropy(model(images[batch]), labels[batch]).backward()
                optimizer.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval(), images[test], labels[test]


def _accuracy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    return (logits.argmax(1) == labels).double().mean().item()


def _check(trained: tuple[nn.Module, torch.Tensor, torch.Tensor], precision: str, backend: str, device: str) -> None:
    model, images, labels = trained
    model, images = copy.deepcopy(model).to(device), images.to(device)
    with torch.no_grad():
        original = model(images)
    assert _accuracy(original, labels.to(device)) > 0.9  # trained: labels that mean something
    optimized = fuser.optimize(model, (images[:5],), precision=precision, backend=backend)
    assert len(optimized.fusion_report.fused) == 3  # the three conv -> BN -> SiLU
    with torch.no_grad():
        out = optimized(images)
    agreement = (out.argmax(1) == original.argmax(1)).double().mean().item()
    assert agreement >= MIN_AGREEMENT, f"{precision}/{backend}: labels agree on {agreement:.2%} of the test images"
    assert _accuracy(out, labels.to(device)) == _accuracy(original, labels.to(device))
    result = fuser.verify(model, optimized, (images[:31],))
    assert result.ok and result.budget == TOLERANCE[precision], str(result)
    assert result.top1_agreement >= MIN_AGREEMENT, str(result)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("backend", ["torch", "interpret"])
def test_digits_labels_survive_optimization(trained, precision: str, backend: str):
    _check(trained, precision, backend, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
def test_digits_labels_survive_optimization_gpu(trained, precision: str):
    _check(trained, precision, "triton", "cuda")
