"""Every tile config a launch can be given (each candidate: what the shipped table, the cost model or a
tuning run may return) computes the right result on the GPU: Triton has miscompiled flattened
(tap x channel block) conv loops at some tile shapes and warp counts, so no config is trusted untested."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from accuracy import assert_close
from kernels_reference import ConvCase, conv_inputs, conv_reference, gemm_reference

from fuser.kernels import (
    Activation,
    Epilogue,
    Residual,
    autotune,
    conv2d_act,
    gemm_act,
    pack_conv_weight,
    pack_gemm_weight,
    set_cache_dir,
)

pytestmark = pytest.mark.gpu

CASES_3X3 = [
    ConvCase("c64_k3_29", 2, 64, 96, (29, 27), 3, padding=(1, 1, 1, 1)),
    ConvCase("late_b1_c256_k3_20", 1, 256, 256, (20, 20), 3, padding=(1, 1, 1, 1)),
    ConvCase("c40_s2_k3_33", 3, 40, 72, (33, 31), 3, stride=2, padding=(1, 1, 1, 1)),
    ConvCase("flat_c8_k3_37", 2, 8, 24, (37, 35), 3, padding=(1, 1, 1, 1)),
    ConvCase("stem_c3_s2_65", 2, 3, 16, (65, 63), 3, stride=2, padding=(1, 1, 1, 1)),
    ConvCase("depthwise_96_k3", 2, 96, 96, (29, 27), 3, padding=(1, 1, 1, 1), groups=96),
]
EPILOGUE = Epilogue(Activation.SILU, residual=Residual.AFTER_ACT)


def _each_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, run: Callable[[str], None]) -> int:
    """Run ``run(label)`` once per candidate of its launch, the launch given that candidate as its default
    (``label`` names it, for the failure message); returns how many candidates there were."""
    monkeypatch.setenv("FUSER_AUTOTUNE", "0")
    seen: list[list[autotune.TileConfig]] = []
    given: list[autotune.TileConfig] = []
    forced = [0]

    def forced_default(kernel: str, candidates: Any, problem: Any, *args: Any) -> autotune.TileConfig:
        seen.append(list(candidates))
        given.append(candidates[min(forced[0], len(candidates) - 1)])
        return given[-1]

    monkeypatch.setattr(autotune, "default_config", forced_default)
    try:
        set_cache_dir(tmp_path)
        run("the only candidate")
        count = len(seen[0]) if seen else 1
        for index in range(1, count):
            forced[0] = index
            set_cache_dir(tmp_path)  # drops the plans, so the launch asks for its config again
            run(str(given[-1]))
    finally:
        set_cache_dir(None)
    return count


@pytest.mark.parametrize(("precision", "dtype"), [("tf32", torch.float32), ("fp16", torch.float16)], ids=str)
@pytest.mark.parametrize("case", CASES_3X3, ids=str)
def test_every_candidate_of_a_3x3_conv_is_correct(
    case: ConvCase, precision: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    x, w, b, residual = conv_inputs(case, EPILOGUE, dtype, device="cuda")
    packed = pack_conv_weight(w, precision, groups=case.groups)
    ref = conv_reference(x, w, b, case, EPILOGUE, residual)

    def run(label: str) -> None:
        out = conv2d_act(
            x, packed, b, stride=case.stride, padding=case.padding, dilation=case.dilation, epilogue=EPILOGUE,
            residual=residual,
        )  # fmt: skip
        assert_close(out, ref, precision, f"{case} {precision} with {label}")

    assert _each_config(monkeypatch, tmp_path, run) >= 2


@pytest.mark.parametrize(("m", "k", "n"), [(1, 1280, 1000), (33, 769, 3071), (1031, 257, 511)], ids=str)
def test_every_candidate_of_a_gemm_is_correct(
    m: int, k: int, n: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    a = torch.randn(m, k, device="cuda")
    weight = torch.randn(n, k, device="cuda") / k**0.5
    bias = torch.randn(n, device="cuda")
    packed = pack_gemm_weight(weight, "tf32")
    epilogue = Epilogue(Activation.GELU)
    ref = gemm_reference(a, weight, bias, epilogue, None)

    def run(label: str) -> None:
        assert_close(gemm_act(a, packed, bias, epilogue=epilogue), ref, "tf32", f"gemm {m}x{k}x{n} with {label}")

    assert _each_config(monkeypatch, tmp_path, run) >= 2
