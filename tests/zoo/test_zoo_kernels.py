"""Real models through fuser's own Triton kernels, run in Triton's interpreter (``backend="interpret"``, ieee):
the kernels' arithmetic and routing on the layer shapes the libraries build (grouped, depthwise, strided and
dilated convs, squeeze-excitation, channel shuffles, concatenations, YOLO's pose head, attention and MLP GEMMs),
against a float64 run of the original. test_zoo.py checks the same models on the torch backend, which runs the
fused ops' references, not the kernels.

All 46 zoo models passed this way on 2026-12-03 (about 40 minutes on one core; the detectors agreeing with
float64 as their own float32 run does, after NMS); this file keeps a sample whose layers cover the rest's kinds,
in about two minutes. Besides the error it checks that every fused call ran a kernel: none fell back to the torch
reference, which would pass the error check without testing a kernel.
"""

from __future__ import annotations

import pytest
from accuracy import TOLERANCE

for _library in ("torchvision", "timm", "ultralytics", "transformers"):
    pytest.importorskip(_library, reason=f"the zoo needs {_library}: `make test` installs it (Makefile, extra 'zoo')")

from zoo_checks import one_thread  # noqa: E402
from zoo_models import ZOO  # noqa: E402

import fuser  # noqa: E402
from fuser.lower import kernel_dispatch  # noqa: E402

pytestmark = pytest.mark.slow

# name -> what its layers add to the sample
SAMPLE = {
    "mobilenet_v3_small": "depthwise convs, squeeze-excitation scales, hardswish and hardsigmoid",
    "shufflenet_v2_x0_5": "channel split and shuffle between the convs, stride-2 depthwise",
    "squeezenet1_1": "fire modules: 1x1 and 3x3 convs side by side, concatenated",
    "timm regnetx_002": "grouped 3x3 convs",
    "lraspp_mobilenet_v3_large": "dilated depthwise convs, a segmentation head with a sigmoid gate",
    "yolov8n-pose": "C2f splits and concatenations read in place, the pose head",
    "timm levit_128s": "linear -> BatchNorm1d over tokens, attention GEMMs",
    "convnext (transformers)": "7x7 depthwise convs, LayerNorm, MLP GEMMs with GELU",
    "gpt2": "GPT-2's Conv1D GEMMs, the tanh GELU",
}


@pytest.mark.parametrize("name", list(SAMPLE))
def test_zoo_model_through_the_interpreted_kernels(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    zoo = next(z for z in ZOO if z.name == name)
    ran: list[str] = []
    fell_back: list[str] = []
    for kind in ("conv2d", "gemm"):
        dispatch = getattr(kernel_dispatch, kind)

        def counted(*args, _dispatch=dispatch, _kind=kind, **kwargs):
            call = _dispatch(*args, **kwargs)
            (ran if call is not None else fell_back).append(f"{_kind} of an input {tuple(args[0].shape)}")
            return call

        monkeypatch.setattr(kernel_dispatch, kind, counted)
    model, x = zoo.build(), zoo.example_input()
    with one_thread():
        optimized = fuser.optimize(model, (x,), backend="interpret", precision="ieee")
        check = fuser.verify(model, optimized, (x,), layers=False)
    fused = len(optimized.fusion_report.fused)
    assert fused and not fell_back, f"{name}: {fused} chains fused, calls that ran the torch reference: {fell_back[:4]}"
    assert len(ran) >= fused, f"{name}: {fused} fused chains but {len(ran)} kernel calls built"
    budget = max(TOLERANCE["ieee"], 2 * check.baseline_error)  # zoo_checks' rule for deep random nets
    assert check.rel_error < budget, f"{name}: {check.rel_error:.1e} from float64 (budget {budget:.0e})\n{check}"
