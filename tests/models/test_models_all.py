"""Every registered model: builds, shapes, determinism by seed, eval mode, sane numerics, tracing and
the expected number of fusable chains."""

from __future__ import annotations

import copy

import pytest
import torch
from accuracy import rel_error
from models_cases import CHEAP_KWARGS, TEST_KWARGS, built, output_of
from models_walk import chain_heads_by_tracing, traced_units
from torch import fx, nn

from fuser.models import MODELS, build

NAMES = list(MODELS)
CLASSIFIERS = ["efficientnet_b0", "resnet50", "resnet26", "vit_tiny"]

# Published parameter counts of the architectures these models copy (ultralytics' model summaries,
# torchvision's and timm's model cards): equal counts mean the same layers and channel tables.
PUBLISHED_PARAMETERS = {
    "yolov8n": 3_157_200,
    "yolov8s": 11_166_560,
    "efficientnet_b0": 5_288_548,
    "resnet50": 25_557_032,
    "vit_tiny": 5_717_416,
}


def _forward(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(x)


def _expected_output_shape(name: str, x: torch.Tensor) -> tuple[int, ...]:
    if name.startswith("yolov8"):
        h, w = x.shape[-2:]
        anchors = sum((h // s) * (w // s) for s in (8, 16, 32))
        return (x.shape[0], 4 + 80, anchors)
    if name == "bert_tiny":
        return tuple(x.shape)
    return (x.shape[0], 1000)


@pytest.mark.parametrize("name", NAMES)
def test_output_shape_and_eval_mode(name: str) -> None:
    model = built(name)
    assert not any(m.training for m in model.modules()), f"{name}: some module is in training mode"
    x, y = output_of(name)
    assert tuple(y.shape) == _expected_output_shape(name, x)
    assert torch.isfinite(y).all()


# One model per builder: yolov8s and resnet50 go through the same code as yolov8n and resnet26.
@pytest.mark.parametrize("name", ["yolov8n", "efficientnet_b0", "resnet26", "vit_tiny", "bert_tiny"])
def test_same_seed_same_weights_other_seed_other_weights(name: str) -> None:
    rng_before = torch.get_rng_state()
    first, again, other = (build(name, seed=seed, **CHEAP_KWARGS[name]) for seed in (0, 0, 1))
    assert torch.equal(torch.get_rng_state(), rng_before), "building touched the global RNG"

    reference = first.state_dict()
    assert reference.keys() == again.state_dict().keys()
    for key, value in again.state_dict().items():
        assert torch.equal(value, reference[key]), f"{name}: seed 0 built twice differs in {key}"
    differing = {k for k, v in other.state_dict().items() if v.is_floating_point() and not torch.equal(v, reference[k])}
    # Everything random differs; only fixed tensors (the DFL's arange weights) may agree.
    fixed = {k for k in reference if k.endswith("dfl.conv.weight")}
    floating = {k for k, v in reference.items() if v.is_floating_point()}
    assert differing == floating - fixed


@pytest.mark.parametrize("name", NAMES)
def test_float32_agrees_with_float64_and_output_scale_is_sane(name: str) -> None:
    x, y = output_of(name)
    y64 = _forward(copy.deepcopy(built(name)).double(), x.double())
    assert rel_error(y, y64) < 1e-5, f"{name}: float32 is {rel_error(y, y64):.2e} from float64"
    if name.startswith("yolov8"):
        boxes, scores = y64[:, :4], y64[:, 4:]
        assert ((scores > 0) & (scores < 1)).all()
        assert 0.05 < scores.std() < 0.5, f"class scores collapsed or saturated: std {scores.std():.3f}"
        assert (boxes[:, 2:] > 0).all(), "box widths and heights must be positive"
        h, w = x.shape[-2:]
        assert boxes[:, 0].abs().max() < 3 * w and boxes[:, 1].abs().max() < 3 * h
    else:
        assert 0.1 < y64.std() < 10, f"{name}: output std {y64.std():.3g} is outside [0.1, 10]"


@pytest.mark.parametrize("name", NAMES)
def test_output_depends_on_the_input(name: str) -> None:
    # A random network whose output ignores its input (everything washed out by depth) would hide
    # errors in its early layers: the two images of the batch must give clearly different outputs.
    # (YOLO's box centres sit on the shared anchor grid; its sizes and scores must differ.)
    _, y = output_of(name)
    y = y[:, 2:] if name.startswith("yolov8") else y
    assert rel_error(y[0], y[1]) > 0.05, f"{name}: outputs of two random inputs differ by {rel_error(y[0], y[1]):.3f}"


@pytest.mark.parametrize("name", NAMES)
def test_batchnorm_statistics_are_randomized(name: str) -> None:
    for module_name, bn in built(name).named_modules():
        if isinstance(bn, nn.BatchNorm2d):
            assert bn.running_mean.std() > 0 and bn.running_var.std() > 0, module_name
            assert bn.weight.std() > 0 and bn.bias.std() > 0, module_name


@pytest.mark.parametrize("name", [n for n in NAMES if n in PUBLISHED_PARAMETERS])
def test_parameter_count_matches_the_published_architecture(name: str) -> None:
    model = built(name) if name not in TEST_KWARGS else build(name)  # the published input size
    assert sum(p.numel() for p in model.parameters()) == PUBLISHED_PARAMETERS[name]


@pytest.mark.parametrize("name", [*CLASSIFIERS, "bert_tiny"])
def test_classifiers_and_encoders_trace_whole_and_run_the_same(name: str) -> None:
    x, y = output_of(name)
    assert torch.equal(_forward(fx.symbolic_trace(built(name)), x), y)


@pytest.mark.parametrize("name", NAMES)
def test_expected_fusions_match_an_independent_walk_of_the_traced_graphs(name: str) -> None:
    model = built(name)
    heads = chain_heads_by_tracing(model)
    assert len(heads) == len(set(heads))
    assert sorted(heads) == sorted(model.expected_chain_heads)
    assert model.expected_fusions == len(heads)


@pytest.mark.parametrize("name", NAMES)
def test_expected_fusions_cover_every_batchnorm(name: str) -> None:
    # In these models every BatchNorm follows a conv, so every BN is in exactly one chain.
    model = built(name)
    batchnorms = sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())
    modules = dict(model.named_modules())
    conv_bias_or_linear = [
        h for h in model.expected_chain_heads if isinstance(modules[h], nn.Linear) or modules[h].bias is not None
    ]
    assert model.expected_fusions == batchnorms + len(conv_bias_or_linear)


def test_models_without_a_shape_check_trace_fully() -> None:
    for name in [*CLASSIFIERS, "bert_tiny"]:
        _, failed = traced_units(built(name))
        assert failed == [], f"{name}: {failed} did not trace"
