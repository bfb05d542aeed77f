"""The compiled kernels on a CUDA GPU: realistic sizes, every precision, both tile-moving paths, the
tensor-core check on the PTX, and the autotune cache with real measurements."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from accuracy import TOLERANCE, assert_close, rel_error
from jit_binds import count_jit_binds
from kernels_reference import EPILOGUES, ConvCase, conv_inputs, conv_reference, gemm_reference

from fuser.kernels import (
    Activation,
    Epilogue,
    Residual,
    autotune,
    conv2d_act,
    conv2d_tile_candidates,
    gemm_act,
    pack_conv_weight,
    pack_gemm_weight,
    set_cache_dir,
)
from fuser.kernels import launch as launch_module
from fuser.kernels.autotune import TileConfig
from fuser.kernels.conv import persistent_variants

pytestmark = pytest.mark.gpu

PRECISIONS = [
    ("tf32", torch.float32),
    ("tf32x3", torch.float32),
    ("ieee", torch.float32),
    ("bf16", torch.float32),
    ("fp16", torch.float32),
    ("fp16", torch.float16),
    ("bf16", torch.bfloat16),
]
PRECISION_IDS = ["tf32", "tf32x3", "ieee", "bf16", "fp16", "fp16-model", "bf16-model"]

CONV_CASES = [
    ConvCase("c64_k3_28", 2, 64, 96, (28, 28), 3, padding=(1, 1, 1, 1)),
    ConvCase("stem_c3_s2_97", 2, 3, 16, (97, 95), 3, stride=2, padding=(1, 1, 1, 1)),
    ConvCase("c19_s2_asym_41", 3, 19, 45, (41, 39), 3, stride=2, padding=(0, 1, 1, 0)),
    ConvCase("pointwise_144_24", 2, 144, 24, (28, 28), 1),
    ConvCase("depthwise_144", 2, 144, 144, (28, 28), 3, padding=(1, 1, 1, 1), groups=144),
    ConvCase("grouped_8_dil2", 2, 64, 64, (21, 19), 3, padding=(2, 2, 2, 2), dilation=2, groups=8),
    ConvCase("stem7_c3_s2_97", 2, 3, 40, (97, 95), 7, stride=2, padding=(3, 3, 3, 3)),  # filter rows
]


def run_conv(case: ConvCase, epilogue: Epilogue, precision: str, dtype: torch.dtype, path: str = "auto"):
    x, w, b, residual = conv_inputs(case, epilogue, dtype, device="cuda")
    out = conv2d_act(
        x,
        pack_conv_weight(w, precision, groups=case.groups),
        b,
        stride=case.stride,
        padding=case.padding,
        dilation=case.dilation,
        epilogue=epilogue,
        residual=residual,
        path=path,
    )
    assert out.dtype == dtype and out.is_contiguous(memory_format=torch.channels_last)
    return out, conv_reference(x, w, b, case, epilogue, residual)


@pytest.mark.parametrize(("precision", "dtype"), PRECISIONS, ids=PRECISION_IDS)
@pytest.mark.parametrize("case", CONV_CASES, ids=str)
def test_conv_precision(case: ConvCase, precision: str, dtype: torch.dtype) -> None:
    epilogue = Epilogue(Activation.SILU, residual=Residual.AFTER_ACT)
    out, ref = run_conv(case, epilogue, precision, dtype)
    assert_close(out, ref, precision, f"{case} {precision} {dtype}")


@pytest.mark.parametrize("epilogue", EPILOGUES, ids=lambda e: e.describe())
@pytest.mark.parametrize("case", [CONV_CASES[0], CONV_CASES[4]], ids=str)
def test_conv_epilogue(case: ConvCase, epilogue: Epilogue) -> None:
    out, ref = run_conv(case, epilogue, "tf32", torch.float32)
    assert_close(out, ref, "tf32", f"{case} {epilogue.describe()}")


@pytest.mark.parametrize("path", ["descriptor", "pointer"])
@pytest.mark.parametrize(
    ("precision", "dtype"), [("tf32", torch.float32), ("bf16", torch.bfloat16)], ids=["tf32", "bf16-model"]
)
@pytest.mark.parametrize(
    "case",
    [
        CONV_CASES[0],
        ConvCase("rows_c8_s2_97", 2, 8, 16, (97, 95), 3, stride=2, padding=(1, 1, 1, 1)),
        ConvCase("flat_k_c5_s2_97", 2, 5, 16, (97, 95), 3, stride=2, padding=(1, 1, 1, 1)),
    ],
    ids=str,
)
def test_conv_paths(case: ConvCase, precision: str, dtype: torch.dtype, path: str) -> None:
    out, ref = run_conv(case, Epilogue(Activation.GELU), precision, dtype, path)
    assert_close(out, ref, precision, f"{case} {path}")


def run_gemm(a: torch.Tensor, n: int, epilogue: Epilogue, precision: str, path: str = "auto"):
    w = torch.randn(n, a.shape[-1], device="cuda") / a.shape[-1] ** 0.5
    b = torch.randn(n, device="cuda")
    residual = None if epilogue.residual == Residual.NONE else torch.randn(*a.shape[:-1], n, device="cuda")
    out = gemm_act(a, pack_gemm_weight(w, precision), b, epilogue=epilogue, residual=residual, path=path)
    assert out.dtype == a.dtype
    return out, gemm_reference(a, w, b, epilogue, residual)


@pytest.mark.parametrize(("precision", "dtype"), PRECISIONS, ids=PRECISION_IDS)
@pytest.mark.parametrize(
    "mkn", [(1, 1024, 1000), (7, 333, 517), (33, 768, 3072), (1000, 1024, 999)], ids=lambda mkn: "x".join(map(str, mkn))
)
def test_gemm_precision(mkn: tuple[int, int, int], precision: str, dtype: torch.dtype) -> None:
    m, k, n = mkn
    a = torch.randn(m, k, device="cuda").to(dtype)
    out, ref = run_gemm(a, n, Epilogue(Activation.GELU, residual=Residual.BEFORE_ACT), precision)
    assert_close(out, ref, precision, f"{mkn} {precision} {dtype}")


@pytest.mark.parametrize("epilogue", EPILOGUES, ids=lambda e: e.describe())
def test_gemm_epilogue(epilogue: Epilogue) -> None:
    out, ref = run_gemm(torch.randn(3, 129, 257, device="cuda"), 383, epilogue, "tf32")
    assert_close(out, ref, "tf32", epilogue.describe())


@pytest.mark.parametrize("path", ["descriptor", "pointer"])
@pytest.mark.parametrize(
    ("precision", "dtype"), [("tf32", torch.float32), ("bf16", torch.bfloat16)], ids=["tf32", "bf16-model"]
)
def test_gemm_paths(precision: str, dtype: torch.dtype, path: str) -> None:
    a = torch.randn(4, 250, 512, device="cuda").to(dtype)
    out, ref = run_gemm(a, 1024, Epilogue(Activation.SILU, residual=Residual.AFTER_ACT, scale=0.5), precision, path)
    assert_close(out, ref, precision, path)


def test_gemm_permuted_3d_input() -> None:
    a = torch.randn(3, 512, 200, device="cuda").transpose(1, 2)
    out, ref = run_gemm(a, 300, Epilogue(Activation.RELU), "tf32")
    assert_close(out, ref, "tf32", "permuted 3-D A")


MMA = re.compile(r"\b(wgmma\.mma_async|mma\.sync)\b")


def compiled_ptx(monkeypatch: pytest.MonkeyPatch, call) -> list[str]:
    """The PTX of every GEMM-style kernel ``call`` launches (every launch goes through kernels/launch.py's
    ``launch``; the split-K reduction, which has no dot, is left out)."""
    module = launch_module
    seen = []
    real = module.launch

    def recording(*args, **kwargs):
        compiled = real(*args, **kwargs)
        seen.append(compiled)
        return compiled

    monkeypatch.setattr(module, "launch", recording)
    call()
    monkeypatch.setattr(module, "launch", real)
    assert seen, "no kernel was launched"
    return [k.asm["ptx"] for k in seen if "split_k_reduce" not in getattr(k, "name", "")]


@pytest.mark.parametrize("precision", ["tf32", "bf16", "fp16", "ieee"])
def test_tensor_cores_in_ptx(monkeypatch: pytest.MonkeyPatch, precision: str) -> None:
    """tf32 / bf16 / fp16 must compile to tensor-core MMA (wgmma or mma); ieee to none (FMA only)."""
    x = torch.randn(2, 64, 30, 30, device="cuda").to(memory_format=torch.channels_last)
    w = pack_conv_weight(torch.randn(64, 64, 3, 3, device="cuda"), precision)
    a = torch.randn(256, 512, device="cuda")
    wg = pack_gemm_weight(torch.randn(384, 512, device="cuda"), precision)
    ptx = compiled_ptx(monkeypatch, lambda: conv2d_act(x, w, padding=1))
    ptx += compiled_ptx(monkeypatch, lambda: gemm_act(a, wg))
    for text in ptx:
        found = MMA.findall(text)
        if precision == "ieee":
            assert not found, f"ieee kernel uses tensor cores: {set(found)}"
        else:
            assert found, f"{precision} kernel has no wgmma / mma instruction"


def test_autotune_cache_on_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real first call measures and writes; a new process (memory dropped) reads without measuring;
    a corrupt file is measured again and rewritten."""
    monkeypatch.setenv("FUSER_AUTOTUNE", "1")
    set_cache_dir(tmp_path)
    try:
        a = torch.randn(300, 512, device="cuda")
        w = pack_gemm_weight(torch.randn(640, 512, device="cuda"), "tf32")
        first = gemm_act(a, w, epilogue=Epilogue(Activation.SILU))
        files = [autotune.cache_file(torch.cuda.get_device_name())]
        (entry,) = json.loads(files[0].read_text())["entries"].values()
        assert sum(t is not None for _, t in entry["timings_ms"]) >= 2

        measured = []
        real_bench = autotune.do_bench_ms
        monkeypatch.setattr(autotune, "do_bench_ms", lambda fn: measured.append(1) or real_bench(fn))
        set_cache_dir(tmp_path)
        second = gemm_act(a, w, epilogue=Epilogue(Activation.SILU))
        assert measured == []
        torch.testing.assert_close(first, second)

        files[0].write_text("\x00garbage")
        set_cache_dir(tmp_path)
        gemm_act(a, w, epilogue=Epilogue(Activation.SILU))
        assert measured, "a corrupt entry must be measured again"
        (rewritten,) = json.loads(files[0].read_text())["entries"].values()
        assert rewritten["key"] == entry["key"]  # rewritten, readable again
    finally:
        set_cache_dir(None)


@pytest.mark.parametrize("case", CONV_CASES[:5], ids=str)
def test_direct_launch_matches_jit_launch(monkeypatch: pytest.MonkeyPatch, case: ConvCase) -> None:
    """A plan's first call goes through JITFunction.run, later ones launch the compiled kernel directly
    (kernels/launch.py): the results must be identical, and the later calls must not bind again."""
    from fuser.kernels import launch as launch_module

    binds = count_jit_binds(monkeypatch)
    epilogue = Epilogue(Activation.HARDSWISH, residual=Residual.AFTER_ACT)
    x, w, b, residual = conv_inputs(case, epilogue, torch.float32, device="cuda")
    packed = pack_conv_weight(w, "tf32", groups=case.groups)

    def call() -> torch.Tensor:
        return conv2d_act(x, packed, b, stride=case.stride, padding=case.padding, dilation=case.dilation,
                          epilogue=epilogue, residual=residual)  # fmt: skip

    first = call()
    assert binds, "the first call of a plan goes through JITFunction.run"
    binds.clear()
    direct = [call() for _ in range(3)]
    assert not binds, f"later calls bound their arguments again: {binds}"
    monkeypatch.setattr(launch_module, "DIRECT_LAUNCH", False)
    jit = call()
    torch.cuda.synchronize()
    for out in [*direct, jit]:
        assert torch.equal(out, first)
    assert_close(first, conv_reference(x, w, b, case, epilogue, residual), "tf32", str(case))

    a = torch.randn(33, 300, device="cuda")
    wg = torch.randn(45, 300, device="cuda")
    packed_g = pack_gemm_weight(wg, "tf32")
    gemm_first = gemm_act(a, packed_g, epilogue=Epilogue(Activation.GELU_TANH))
    gemm_again = gemm_act(a, packed_g, epilogue=Epilogue(Activation.GELU_TANH))
    assert torch.equal(gemm_first, gemm_again)


# Every tile config the candidate lists can return (defaults, measured choices, split-K and small-tile
# variants), on 3x3 convs of each routing: Triton has miscompiled flattened (tap x channel block) conv
# loops at num_warps=8 (pytorch issue 173068), so no config is trusted untested. Late layers at batch 1
# give the split-K variants; odd channels and stride 2 give masks and the pointer path.
SWEEP_3X3 = [
    ConvCase("c64_20_b2", 2, 64, 64, (20, 20), 3, padding=(1, 1, 1, 1)),
    ConvCase("c512_7_b1", 1, 512, 512, (7, 7), 3, padding=(1, 1, 1, 1)),
    ConvCase("c256_13_b1_s2", 1, 256, 384, (13, 13), 3, stride=2, padding=(1, 1, 1, 1)),
    ConvCase("c19_41_odd", 3, 19, 45, (41, 39), 3, stride=2, padding=(0, 1, 1, 0)),
    ConvCase("flat_c5_33", 2, 5, 24, (33, 31), 3, padding=(1, 1, 1, 1)),
    ConvCase("rows_c8_33", 2, 8, 24, (33, 31), 3, padding=(1, 1, 1, 1)),
    ConvCase("rows_7x7_c3_67", 2, 3, 64, (67, 65), 7, stride=2, padding=(3, 3, 3, 3)),
    ConvCase("stem_c3_97", 2, 3, 16, (97, 95), 3, stride=2, padding=(1, 1, 1, 1)),
    ConvCase("depthwise_96_b1", 1, 96, 96, (15, 15), 3, padding=(1, 1, 1, 1), groups=96),
    ConvCase("depthwise_72_k5_s2", 1, 72, 72, (29, 27), 5, stride=2, padding=(2, 2, 2, 2), groups=72),
    ConvCase("dil21_c64", 1, 64, 48, (17, 15), 3, padding=(2, 2, 1, 1), dilation=(2, 1)),
    # box tiles (conv_boxes.py, the default from BOX_MIN_ROWS output pixels, 64 input channels, stride 1, 64
    # columns): boxes cut by odd image edges, asymmetric padding, a last channel block partly past C
    ConvCase("box_c64_75x77", 3, 64, 96, (75, 77), 3, padding=(1, 1, 1, 1)),
    ConvCase("box_c80_asym_61x67", 5, 80, 56, (61, 67), 3, padding=(0, 2, 1, 1)),
    # 264 output channels: the box list's 128x256 tile, whose shape the shifted taps miscompiled (NOTES version 14)
    ConvCase("box_c64_264_69x65", 4, 64, 264, (69, 65), 3, padding=(1, 1, 1, 1)),
    # 26 tiles of 128x128 over 36 (fp16) or 72 (tf32) steps, the last row tile partly past M, the channels ending
    # inside the second column tile: small-grid split-K candidates, and the stream-K test below
    ConvCase("c256_19x17_b5", 5, 256, 200, (19, 17), 3, padding=(1, 1, 1, 1)),
]

# Stream-K (conv.py), which no candidate list offers: forced, as benchmarks/conv_tile_sweep.py runs it. One or two
# programs per SM over 13-26 tiles of 36-72 steps: every tile shared by several programs (up to 10), its partial
# sums added by the last to arrive.
STREAM_K_TILES = [(128, 128, 8, 4, 1), (128, 128, 8, 3, 2), (64, 256, 8, 3, 1), (64, 128, 4, 4, 2)]


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [("tf32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)],
    ids=["tf32", "bf16", "fp16"],
)
def test_stream_k_on_the_gpu(precision: str, dtype: torch.dtype) -> None:
    """Against float64, twice in a row (the arrival counters must be back at zero), the same bits both times."""
    case = next(c for c in SWEEP_3X3 if c.name == "c256_19x17_b5")
    epilogue = Epilogue(Activation.SILU, residual=Residual.AFTER_ACT)
    x, w, b, residual = conv_inputs(case, epilogue, dtype, device="cuda")
    packed = pack_conv_weight(w, precision)
    ref = conv_reference(x, w, b, case, epilogue, residual)
    block_k = 32 if dtype == torch.float32 else 64
    for block_m, block_n, warps, stages, stream_k in STREAM_K_TILES:
        tile = TileConfig(block_m, block_n, block_k, 8, warps, stages, stream_k=stream_k)
        first, second = (
            conv2d_act(x, packed, b, padding=case.padding, epilogue=epilogue, residual=residual, tile=tile)
            for _ in range(2)
        )
        assert torch.equal(first, second), f"{tile}: two launches differ"
        assert_close(second, ref, precision, f"stream-K {tile}")


def forced_tile_error(
    case: ConvCase,
    x: torch.Tensor,
    packed: Any,
    b: torch.Tensor,
    residual: Any,
    ref: torch.Tensor,
    epilogue: Epilogue,
    config: TileConfig,
) -> float | None:
    """The relative error against ``ref`` of ``case`` run with ``config`` forced, or None where the config does not
    fit in shared memory (autotune counts such a config as infinitely slow: never chosen by measurement)."""
    from triton.runtime.errors import OutOfResources

    try:
        out = conv2d_act(x, packed, b, stride=case.stride, padding=case.padding, dilation=case.dilation,
                         epilogue=epilogue, residual=residual, tile=config)  # fmt: skip
    except OutOfResources:
        return None
    return rel_error(out, ref)


# Every conv wider than 1x1 of fuser.models' YOLOv8n, YOLOv8s, ResNet-50 and EfficientNet-B0 (the shapes of
# ultralytics' and torchvision's builds), as (C_in, C_out, kernel, stride, padding, input size, groups), listed by a
# forward with hooks. With tune=True any candidate of theirs can be chosen at any batch, so every one runs.
MODEL_CONVS = [
    (3, 16, 3, 2, 1, 640, 1), (3, 32, 3, 2, 1, 224, 1), (3, 32, 3, 2, 1, 640, 1), (3, 64, 7, 2, 3, 224, 1),
    (16, 16, 3, 1, 1, 160, 1), (16, 32, 3, 2, 1, 320, 1), (32, 32, 3, 1, 1, 80, 1), (32, 32, 3, 1, 1, 112, 32),
    (32, 32, 3, 1, 1, 160, 1), (32, 64, 3, 2, 1, 160, 1), (32, 64, 3, 2, 1, 320, 1), (64, 64, 3, 1, 1, 20, 1),
    (64, 64, 3, 1, 1, 40, 1), (64, 64, 3, 1, 1, 56, 1), (64, 64, 3, 1, 1, 80, 1), (64, 64, 3, 2, 1, 80, 1),
    (64, 80, 3, 1, 1, 80, 1), (64, 128, 3, 2, 1, 80, 1), (64, 128, 3, 2, 1, 160, 1), (80, 80, 3, 1, 1, 20, 1),
    (80, 80, 3, 1, 1, 40, 1), (80, 80, 3, 1, 1, 80, 1), (96, 96, 3, 2, 1, 112, 96), (128, 64, 3, 1, 1, 40, 1),
    (128, 64, 3, 1, 1, 80, 1), (128, 80, 3, 1, 1, 40, 1), (128, 128, 3, 1, 1, 20, 1), (128, 128, 3, 1, 1, 28, 1),
    (128, 128, 3, 1, 1, 40, 1), (128, 128, 3, 1, 1, 80, 1), (128, 128, 3, 2, 1, 40, 1), (128, 128, 3, 2, 1, 56, 1),
    (128, 128, 3, 2, 1, 80, 1), (128, 256, 3, 2, 1, 40, 1), (128, 256, 3, 2, 1, 80, 1), (144, 144, 3, 1, 1, 56, 144),
    (144, 144, 5, 2, 2, 56, 144), (240, 240, 3, 2, 1, 28, 240), (240, 240, 5, 1, 2, 28, 240),
    (256, 64, 3, 1, 1, 20, 1), (256, 64, 3, 1, 1, 40, 1), (256, 80, 3, 1, 1, 20, 1), (256, 128, 3, 1, 1, 40, 1),
    (256, 256, 3, 1, 1, 14, 1), (256, 256, 3, 1, 1, 20, 1), (256, 256, 3, 2, 1, 28, 1), (256, 256, 3, 2, 1, 40, 1),
    (256, 512, 3, 2, 1, 40, 1), (480, 480, 3, 1, 1, 14, 480), (480, 480, 5, 1, 2, 14, 480),
    (512, 64, 3, 1, 1, 20, 1), (512, 128, 3, 1, 1, 20, 1), (512, 512, 3, 1, 1, 7, 1), (512, 512, 3, 2, 1, 14, 1),
    (672, 672, 5, 1, 2, 14, 672), (672, 672, 5, 2, 2, 14, 672), (1152, 1152, 3, 1, 1, 7, 1152),
    (1152, 1152, 5, 1, 2, 7, 1152),
]  # fmt: skip
MODEL_TILE_SHARDS = 8


def model_conv_tiles(precision: str, dtype: torch.dtype) -> list[tuple[ConvCase, TileConfig]]:
    """Each distinct tile config the models' convs list as candidates at batch 1, 8 or 32, with the first conv
    and batch that lists it (in the order above: the smallest batch first)."""
    first: dict[TileConfig, ConvCase] = {}
    for c_in, c_out, k, stride, pad, size, groups in MODEL_CONVS:
        packed = pack_conv_weight(torch.randn(c_out, c_in // groups, k, k).to(dtype), precision, groups=groups)
        for batch in (1, 8, 32):
            name = f"{c_in}->{c_out}_k{k}s{stride}g{groups}@{size}_b{batch}"
            case = ConvCase(name, batch, c_in, c_out, (size, size), k, stride=stride, padding=(pad,) * 4, groups=groups)
            for config in conv2d_tile_candidates((batch, c_in, size, size), packed, stride, case.padding):
                first.setdefault(config, case)
    return [(case, config) for config, case in first.items()]


@pytest.mark.parametrize(
    ("precision", "dtype"), [("tf32", torch.float32), ("fp16", torch.float16)], ids=["tf32", "fp16-model"]
)
@pytest.mark.parametrize("shard", range(MODEL_TILE_SHARDS))
def test_every_tile_the_models_convs_can_choose(shard: int, precision: str, dtype: torch.dtype) -> None:
    """Each config forced on a conv that lists it, against float64 (one shard of the list per test, so that
    workers share the compiles)."""
    epilogue = Epilogue(Activation.SILU, residual=Residual.AFTER_ACT)
    tiles = model_conv_tiles(precision, dtype)
    assert len(tiles) > 50, f"only {len(tiles)} distinct configs: the candidate lists or MODEL_CONVS changed"
    wrong, ran = [], 0
    for case, config in tiles[shard::MODEL_TILE_SHARDS]:
        x, w, b, residual = conv_inputs(case, epilogue, dtype, device="cuda")
        packed = pack_conv_weight(w, precision, groups=case.groups)
        ref = conv_reference(x, w, b, case, epilogue, residual)
        error = forced_tile_error(case, x, packed, b, residual, ref, epilogue, config)
        if error is None:
            continue
        ran += 1
        if not error <= TOLERANCE[precision]:
            wrong.append((case.name, config, error))
    assert not wrong, f"{precision}: configs beyond tolerance {TOLERANCE[precision]}: {wrong}"
    assert ran > 0, f"{precision}: no config of shard {shard} fits"


# Shifted taps over a zero-bordered input (conv_boxes.py), forced as benchmarks/conv_tile_sweep.py
# runs them: (block_m, block_n, warps, stages, split_k), on the sweep's stride-1 convs whose output has the input's
# size. The masked kind computed the 128x256 unsplit tile wrong on the GPU (kernels/NOTES.md version 14).
SHIFT_TILES = [(128, 128, 8, 4, 1), (128, 128, 8, 3, 1), (64, 128, 4, 4, 2), (128, 64, 4, 4, 1), (64, 256, 8, 3, 1),
               (128, 256, 8, 3, 1), (128, 256, 8, 3, 2)]  # fmt: skip
SHIFT_CASES = ["c64_20_b2", "c512_7_b1", "c256_19x17_b5", "box_c64_264_69x65"]


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [("tf32", torch.float32), ("ieee", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)],
    ids=["tf32", "ieee", "bf16-model", "fp16-model"],
)
@pytest.mark.parametrize("name", SHIFT_CASES)
def test_shifted_taps_on_the_gpu(name: str, precision: str, dtype: torch.dtype) -> None:
    case = next(c for c in SWEEP_3X3 if c.name == name)
    epilogue = Epilogue(Activation.SILU, residual=Residual.AFTER_ACT)
    x, w, b, residual = conv_inputs(case, epilogue, dtype, device="cuda")
    packed = pack_conv_weight(w, precision)
    ref = conv_reference(x, w, b, case, epilogue, residual)
    block_k = 32 if dtype == torch.float32 else 64
    ran = 0
    for block_m, block_n, warps, stages, split_k in SHIFT_TILES:
        tile = TileConfig(block_m, block_n, block_k, 8, warps, stages, split_k, tap_shift=1)
        error = forced_tile_error(case, x, packed, b, residual, ref, epilogue, tile)
        if error is None:
            continue
        ran += 1
        assert error < TOLERANCE[precision], f"{name} shifted taps {tile}: relative error {error:.3e} ({precision})"
    assert ran == len(SHIFT_TILES), f"{name}: only {ran} of the shifted-tap tiles fit"


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [("tf32", torch.float32), ("ieee", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)],
    ids=["tf32", "ieee", "bf16-model", "fp16-model"],
)
@pytest.mark.parametrize("case", SWEEP_3X3, ids=str)
def test_every_tile_candidate_on_3x3(case: ConvCase, precision: str, dtype: torch.dtype) -> None:
    epilogue = Epilogue(Activation.SILU, residual=Residual.AFTER_ACT)
    x, w, b, residual = conv_inputs(case, epilogue, dtype, device="cuda")
    packed = pack_conv_weight(w, precision, groups=case.groups)
    ref = conv_reference(x, w, b, case, epilogue, residual)
    configs = conv2d_tile_candidates(x.shape, packed, case.stride, case.padding, case.dilation)
    wrong, no_fit = [], []
    for config in configs:
        error = forced_tile_error(case, x, packed, b, residual, ref, epilogue, config)
        if error is None:
            no_fit.append(config)
        elif not error <= TOLERANCE[precision]:
            wrong.append((config, error))
    assert not wrong, f"{case} {precision}: configs beyond tolerance {TOLERANCE[precision]}: {wrong}"
    assert configs[0] not in no_fit, f"{case} {precision}: the default config does not fit: {configs[0]}"


@pytest.mark.parametrize(
    ("precision", "dtype"), [("tf32", torch.float32), ("fp16", torch.float16)], ids=["tf32", "fp16-model"]
)
@pytest.mark.parametrize("case", [c for c in SWEEP_3X3 if c.groups == 1 and c.c_in > 4], ids=str)
def test_persistent_twins_on_3x3(case: ConvCase, precision: str, dtype: torch.dtype) -> None:
    """Each whole-tile candidate on a persistent grid of 1-3 programs per SM (TileConfig.persistent), as the tile
    sweep measures them (the lists offer the 4-warp twins on grids of many tiles, which the models' test above
    runs): Triton flattens its tile loop with the reduction loop, the kind of loop nest it has miscompiled at 8
    warps (issue 8 item 6), so every twin is checked against float64."""
    epilogue = Epilogue(Activation.SILU, residual=Residual.AFTER_ACT)
    x, w, b, residual = conv_inputs(case, epilogue, dtype, device="cuda")
    packed = pack_conv_weight(w, precision, groups=case.groups)
    ref = conv_reference(x, w, b, case, epilogue, residual)
    configs = conv2d_tile_candidates(x.shape, packed, case.stride, case.padding, case.dilation)
    twins = persistent_variants(configs, (1, 2, 3))
    wrong, ran = [], 0
    for config in twins:
        error = forced_tile_error(case, x, packed, b, residual, ref, epilogue, config)
        ran += error is not None
        if error is not None and not error <= TOLERANCE[precision]:
            wrong.append((config, error))
    assert twins and ran, f"{case} {precision}: no persistent twin ran"
    assert not wrong, f"{case} {precision}: persistent twins beyond tolerance {TOLERANCE[precision]}: {wrong}"
