"""The registry: build(name, seed=..., **kwargs), example_input(name, ...), MODELS, and their errors."""

from __future__ import annotations

import pytest
import torch
from models_cases import CHEAP_KWARGS

from fuser.models import MODELS, build, example_input


def test_the_issue_names_are_registered() -> None:
    assert {"yolov8n", "efficientnet_b0", "resnet50", "vit_tiny", "bert_tiny"} <= set(MODELS)
    assert all(spec.description for spec in MODELS.values())


def test_unknown_name_lists_the_known_ones() -> None:
    with pytest.raises(KeyError, match=r"unknown model 'yolov9'.*yolov8n.*resnet50.*bert_tiny"):
        build("yolov9")
    with pytest.raises(KeyError, match=r"unknown model 'resnet18'.*efficientnet_b0"):
        example_input("resnet18")


@pytest.mark.parametrize(
    ("name", "kwargs", "expected"),
    [
        ("yolov8n", {}, (1, 3, 640, 640)),
        ("yolov8s", {"batch": 2, "size": (96, 160)}, (2, 3, 96, 160)),
        ("efficientnet_b0", {"size": 67}, (1, 3, 67, 67)),
        ("resnet50", {"batch": 3}, (3, 3, 224, 224)),
        ("vit_tiny", {}, (1, 3, 224, 224)),
        ("bert_tiny", {"batch": 2, "size": 37}, (2, 37, 128)),
        ("bert_tiny", {}, (1, 128, 128)),
    ],
)
def test_example_input_shape(name: str, kwargs: dict, expected: tuple[int, ...]) -> None:
    assert tuple(example_input(name, **kwargs).shape) == expected


def test_example_input_is_random_never_zero_and_deterministic_by_seed() -> None:
    a, b, c = (example_input("resnet50", size=(21, 19), seed=s) for s in (0, 0, 1))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert (a != 0).all() and 0.8 < a.std() < 1.2
    rng = torch.get_rng_state()
    example_input("bert_tiny", size=5)
    assert torch.equal(torch.get_rng_state(), rng), "example_input touched the global RNG"


def test_example_input_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="batch must be at least 1, got 0"):
        example_input("resnet50", batch=0)
    with pytest.raises(TypeError, match="bert_tiny takes a sequence length as size, got \\(3, 4\\)"):
        example_input("bert_tiny", size=(3, 4))


def test_build_passes_options_to_the_builder() -> None:
    model = build("resnet26", num_classes=7, width=16, **CHEAP_KWARGS["resnet26"])
    with torch.no_grad():
        y = model(example_input("resnet26", batch=2, size=(33, 29)))
    assert y.shape == (2, 7)
    assert model.conv1.out_channels == 16


def test_encoders_run_on_their_default_example_input() -> None:
    # (The conv models at their default sizes are too slow for CPU tests; they run at test sizes.)
    for name in ("vit_tiny", "bert_tiny"):
        with torch.no_grad():
            assert torch.isfinite(build(name)(example_input(name))).all()
