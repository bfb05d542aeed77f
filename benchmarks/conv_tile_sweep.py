"""Tiles and reduction orders of single conv layers on the GPU, against cuDNN, each configuration checked
against float64: the layers the whole-model timelines named as the slowest for their bytes.

    python -m benchmarks.conv_tile_sweep --out DIR [--budget-s 200] [--only stem,narrow,late,rgb] [--layers NAME,...]
        [--regimes 32:float16,1:float32,32:float32,1:float16]

Four groups of layers (the first two from benchmarks/kernel_timeline.py, H200, untuned, batch 32 fp16):

- ``stem``: ResNet-50's 7x7 stride-2 conv on 3 channels took 0.30 ms (about 20% of the forward) in the flat-K
  order whatever the tile. Each layer runs in the flat-K order and in the filter-row order
  (kernels/conv_choice.py ``reduction_order``), over the candidates of each.
- ``narrow``: EfficientNet-B0's 1x1 convs of 16-32 input channels at 112x112 and 56x56 (M = 100k-400k rows,
  K = 16-144) took 20-75 us, 2.5-6x their bytes at 3 TB/s, on tiles with a 64-wide K step over a K of 16 or
  32. Each runs over its candidates plus tiles whose K step is the whole K, 128-256 rows, 4 or 8 warps; with
  the squeeze-excitation channel scale as the operand prologue where the model has it.
- ``late``: the batch-32 3x3 rows of the layer benchmark slower than cuDNN (results/layers-2026-12-03b.json):
  YOLO's 256->256 @20 and ResNet's 512->512 @7 (a long K over a grid of 52-200 tiles of 128x128, so a wave of
  132 SMs is partly idle) and 64->128 stride 2 @160, and YOLO's 64->64 @80 (3x its floor on box tiles); and
  ResNet-50's stride-1 3x3 convs at 28x28 and 14x14, where tuning chose shifted taps that the shipped table does
  not rank (results/gpu-models-2026-12-03g-tuned.json: the table's runs measured only the stride-2 conv of the
  same GEMM shape); and the 3x3 convs of YOLOv8n's detect head at 80x80 (64->80, 80->80), which share a table
  class with the stride-2 layer at batch 32 and the second of which was slower than cuDNN in channel blocks
  (kernels/NOTES.md version 20): 80->80, routed to flat K since (version 21), also runs in the channel-block
  order it left (``reduction_orders``). Each runs over its candidates plus
  split-K variants of the larger tiles, a 64-wide TF32 K step, 256-row tiles at 64 channels (their box tiles also
  on a persistent grid of one program per SM), box tiles on the stride-2 layer, and every whole candidate on a
  persistent grid of 1-3 programs per SM (TileConfig.persistent; so do the implicit-GEMM layers of the other
  groups).
- ``rgb``: the RGB stems of YOLOv8n (3->16 stride 2 @640), EfficientNet-B0 (3->32 @224) and MobileNetV3 (3->16
  @224) through the direct kernel on larger and smaller programs (its [channels, pixels] accumulator: 1 to 8
  pixels per lane). The implicit GEMM's two reduction orders ran here too until
  results/conv-tile-sweep-2026-12-03f.json found them 1.7x slower; the direct kernel's packed layout is its own
  since, so the stem no longer reroutes. ``cache_entries`` hands these rows to the table as the direct kernel's.

Timings replay a CUDA graph (fuser.kernels.autotune.do_bench_ms); ``cudnn_ms`` is what torch.compile runs
for such a block: cuDNN's conv on the folded weights (channels_last), then the activation. Writes
``conv-tile-sweep.json``; prints per layer cuDNN's, the default's and the best configuration's times.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

# name: (C_in, C_out, kernel, stride, padding, input size, channel-scale prologue, activation)
LAYERS: dict[str, list[tuple[str, int, int, int, int, int, int, bool, str]]] = {
    "stem": [
        ("resnet50.conv1", 3, 64, 7, 2, 3, 224, False, "relu"),
        ("vit_b16.patch_embed", 3, 96, 16, 16, 0, 224, False, "none"),
    ],
    "narrow": [
        ("effnet_b0.b1.project", 32, 16, 1, 1, 0, 112, True, "none"),
        ("effnet_b0.b2.expand", 16, 96, 1, 1, 0, 112, False, "silu"),
        ("effnet_b0.b2.project", 96, 24, 1, 1, 0, 56, True, "none"),
        ("effnet_b0.b3.expand", 24, 144, 1, 1, 0, 56, False, "silu"),
        ("effnet_b0.b3.project", 144, 24, 1, 1, 0, 56, True, "none"),
        ("effnet_b0.b4.project", 144, 40, 1, 1, 0, 28, True, "none"),
    ],
    "late": [
        ("yolov8.256x3x3@20", 256, 256, 3, 1, 1, 20, False, "silu"),
        ("resnet50.layer4.3x3@7", 512, 512, 3, 1, 1, 7, False, "relu"),
        ("yolov8.64->128s2@160", 64, 128, 3, 2, 1, 160, False, "silu"),
        ("yolov8.64x3x3@80", 64, 64, 3, 1, 1, 80, False, "silu"),
        ("resnet50.layer2.3x3@28", 128, 128, 3, 1, 1, 28, False, "relu"),
        ("resnet50.layer3.3x3@14", 256, 256, 3, 1, 1, 14, False, "relu"),
        ("yolov8.head.64->80@80", 64, 80, 3, 1, 1, 80, False, "silu"),
        ("yolov8.head.80x3x3@80", 80, 80, 3, 1, 1, 80, False, "silu"),
        # the head's other scales: their table classes were measured by whole-model tuning in channel blocks
        ("yolov8.head.80x3x3@40", 80, 80, 3, 1, 1, 40, False, "silu"),
        ("yolov8.head.80x3x3@20", 80, 80, 3, 1, 1, 20, False, "silu"),
    ],
    "rgb": [
        ("yolov8.stem", 3, 16, 3, 2, 1, 640, False, "silu"),
        ("effnet_b0.stem", 3, 32, 3, 2, 1, 224, False, "silu"),
        ("mobilenet_v3.stem", 3, 16, 3, 2, 1, 224, False, "hardswish"),
    ],
}
REGIMES = {"32:float16": (32, "float16", "fp16"), "1:float32": (1, "float32", "tf32"),
           "32:float32": (32, "float32", "tf32"), "1:float16": (1, "float16", "fp16")}  # fmt: skip


def extra_tiles(c_in: int, c_out: int, k: int = 1, stride: int = 1, elem: int = 2) -> list[Any]:
    """Whole-K tiles for short reductions (K <= 64): 128-256 rows, the output's channels in one or two tiles.
    For 3x3 convs, :func:`long_k_tiles`."""
    from fuser.kernels.autotune import TileConfig

    if k == 3 and c_in < 16:  # the RGB stem through the implicit GEMM: narrow tiles, K in one or two steps
        return [TileConfig(bm, 16, bk, 8, w, s) for bm in (128, 256) for bk in (16, 32) for w, s in ((4, 2), (8, 3))]
    if k == 3:
        return long_k_tiles(c_in, c_out, stride, elem)
    if c_in > 64:
        return []
    bk = max(16, 1 << (c_in - 1).bit_length())
    bn = min(128, max(16, 1 << (c_out - 1).bit_length()))
    shapes = [(128, bn, 4, 2), (256, bn, 8, 2), (256, bn, 4, 2), (128, bn, 4, 3), (256, bn, 8, 3), (512, bn, 8, 2)]
    if bn > 32:
        shapes += [(256, bn // 2, 4, 2), (128, bn // 2, 4, 2)]
    return [TileConfig(bm, n, bk, 8, warps, stages) for bm, n, warps, stages in shapes]


def direct_tiles(c_out: int) -> list[Any]:
    """The direct kernel (the RGB stem) on programs beside its candidates: 1, 2 and 8 pixels per lane for 16
    channels (``rows / (32 * warps)``), 2-8 warps."""
    from fuser.kernels.autotune import TileConfig
    from fuser.kernels.packing import direct_block_n

    bn = direct_block_n(c_out)
    return [TileConfig(bm, bn, 1, 1, w, 1) for bm, w in ((128, 4), (128, 2), (1024, 4), (2048, 8), (512, 8), (64, 2))]


def long_k_tiles(c_in: int, c_out: int, stride: int, elem: int) -> list[Any]:
    """Tiles for 3x3 convs whose grid of 128x128 tiles leaves SMs idle: split-K 1-4 of 64- to 256-wide tiles,
    TF32 with a 64-wide K step, at stride 1 shifted taps over a zero-bordered input (labels ending in 't'), and
    at stride 2 box tiles of 16 columns. (Stream-K ran here in results/conv-tile-sweep-2026-12-03b.json and the
    masked shifted taps in -03c.json: kernels/NOTES.md versions 13 and 14.)"""
    from fuser.kernels.autotune import TileConfig

    bk = 64 if elem == 2 else 32
    bn_cap = max(64, 1 << (c_out - 1).bit_length())
    shapes = [(128, 128, 8, 4, 1), (128, 128, 8, 4, 2), (128, 128, 8, 3, 3), (128, 128, 8, 3, 4),
              (64, 128, 4, 4, 1), (64, 128, 4, 4, 2), (64, 128, 4, 4, 3), (128, 64, 4, 4, 2),
              (64, 256, 8, 3, 1), (64, 256, 8, 3, 2), (128, 256, 8, 3, 2), (64, 64, 4, 4, 4)]  # fmt: skip
    out = [TileConfig(bm, min(bn, bn_cap), bk, 8, w, s, k) for bm, bn, w, s, k in shapes]
    if elem == 4:
        out += [TileConfig(128, min(128, bn_cap), 64, 8, 8, 3, k) for k in (1, 2)]
    if stride == 1:  # shifted taps over a zero-bordered input (conv_boxes.py), whole and split in two
        out += [TileConfig(bm, min(bn, bn_cap), bk, 8, w, s, k, tap_shift=1) for bm, bn, w, s, k in
                [(128, 128, 8, 4, 1), (128, 128, 8, 3, 1), (128, 128, 8, 4, 2), (64, 128, 4, 4, 1),
                 (64, 128, 4, 4, 2), (128, 64, 4, 4, 1), (64, 256, 8, 3, 1), (64, 256, 8, 3, 2),
                 (128, 256, 8, 3, 1), (128, 256, 8, 3, 2)]]  # fmt: skip
    if stride == 1 and c_in <= 64:  # 256-row tiles, half the weight reads per output (slower: sweep -03f.json)
        out += [TileConfig(256, min(64, bn_cap), bk, 8, 8, s, 1, box, tap_shift=shift)
                for s in (3, 4) for box, shift in ((16, 0), (0, 0), (0, 1))]  # fmt: skip
        # and their boxes on one program per SM, walking tiles (kernels/NOTES.md version 20)
        out += [TileConfig(256, min(64, bn_cap), bk, 8, 8, s, 1, 16, persistent=1) for s in (3, 4)]
    if stride == 2:
        out += [TileConfig(bm, min(bn, bn_cap), bk, 8, w, s, 1, 16) for bm, bn, w, s in
                [(64, 128, 4, 4), (128, 128, 8, 3), (128, 64, 4, 4), (64, 128, 4, 3), (128, 128, 4, 4)]]  # fmt: skip
    return out


def flat_k_tiles(c_out: int, elem: int) -> list[Any]:
    """Flat-K row tiles with other K steps than the lists' (kernels/NOTES.md version 22): 16 and 32 wide, whose
    float32 stages leave room for two or three programs per SM, and 64 and 128 wide, fewer steps; those whose
    pipeline cannot fit in shared memory left out."""
    from fuser.kernels.autotune import TileConfig
    from fuser.kernels.tile_heuristic import pipeline_fits

    bn = min(128, max(16, 1 << (c_out - 1).bit_length()))
    shapes = [(128, 32, 8, 3), (128, 32, 8, 4), (128, 32, 8, 5), (128, 32, 4, 4), (256, 32, 8, 3), (64, 32, 4, 4),
              (128, 64, 8, 2), (128, 128, 8, 2), (128, 128, 8, 3), (64, 128, 4, 3), (128, 16, 8, 4), (128, 16, 8, 6),
              (256, 32, 8, 2), (128, 32, 4, 3), (64, 32, 4, 3), (128, 32, 8, 2),
              # 64-row tiles whose wide steps still leave room for a second program per SM
              (64, 64, 4, 2), (64, 64, 8, 2), (64, 128, 4, 2), (64, 128, 8, 2), (64, 64, 4, 3)]  # fmt: skip
    tiles = [TileConfig(bm, bn, bk, 8, w, s) for bm, bk, w, s in shapes]
    return [t for t in tiles if pipeline_fits(t, elem)]


# Every whole candidate also runs on persistent grids of this many programs per SM (labels ending in 'p' and the
# count; conv.persistent_variants): more than the lists offer (conv.PERSISTENT_PER_SM, 4-warp tiles only)
SWEEP_PER_SM = (1, 2, 3)


# conv_choice's routing constants a sweep's reduction order sets: the filter-row order's minimum run, the direct
# kernel's tap limit, the channel count from which the implicit GEMM reduces over channel blocks, and the share of
# padded channel-block lanes above which it reduces over flat K instead
ROUTING = ("ROW_RUN_MIN", "MAX_DIRECT_TAPS", "FLAT_K_BELOW", "FLAT_K_PAD_ABOVE")


def shipped_routing() -> tuple[float, ...]:
    from fuser.kernels import conv_choice

    return tuple(getattr(conv_choice, constant) for constant in ROUTING)


def rerouted(**values: float) -> tuple[float, ...]:
    """The shipped routing with the named ``ROUTING`` constants set to ``values``."""
    unknown = set(values) - set(ROUTING)
    if unknown:
        raise ValueError(f"not routing constants: {sorted(unknown)} (ROUTING: {ROUTING})")
    return tuple(values.get(constant, shipped) for constant, shipped in zip(ROUTING, shipped_routing(), strict=True))


def reduction_orders(name: str, c_in: int, k: int = 3) -> dict[str, tuple[float, ...]]:
    """The routings (values of ``ROUTING``) layer ``name`` runs under, by label prefix: the shipped one, unprefixed;
    for the stems the filter-row order ('rows') and the flat-K order ('flat'); for a ``k x k`` conv of ``c_in``
    channels that the shipped routing sends to flat K because channel blocks would pad them (80: kernels/NOTES.md
    version 21) also the channel blocks it left ('blocks'). Prefixed labels stay out of the table
    (:func:`cache_entries`): the table does not choose the order."""
    from fuser.kernels import conv_choice

    shipped = shipped_routing()
    if name in {n for n, *_ in LAYERS["stem"]}:
        return {"rows": shipped, "flat": rerouted(ROW_RUN_MIN=10**9)}
    padded = conv_choice.reduction_order(c_in, k, k) == conv_choice.ConvKernel.IMPLICIT_GEMM_FLAT_K
    if padded and c_in >= conv_choice.FLAT_K_BELOW:
        return {"": shipped, "blocks": rerouted(FLAT_K_PAD_ABOVE=1.0)}
    return {"": shipped}


@contextlib.contextmanager
def routed(order: tuple[float, ...]) -> Iterator[None]:
    """Route convs as ``order`` (values of ``ROUTING``) says, the shipped routing put back after."""
    from fuser.kernels import conv_choice

    shipped = shipped_routing()
    for constant, value in zip(ROUTING, order, strict=True):
        setattr(conv_choice, constant, value)
    try:
        yield
    finally:
        for constant, value in zip(ROUTING, shipped, strict=True):
            setattr(conv_choice, constant, value)


def layer_row(layer: tuple, batch: int, dtype_name: str, precision: str) -> dict[str, Any]:
    from fuser.epilogue import Activation, Epilogue
    from fuser.kernels import autotune, conv, conv_choice, pack_conv_weight
    from fuser.kernels.autotune import do_bench_ms
    from fuser.kernels.bordered_copy import bordered_copy

    name, c_in, c_out, k, stride, pad, size, scaled, act = layer
    dtype = getattr(torch, dtype_name)
    gen = torch.Generator().manual_seed(c_in * 131 + c_out)
    x64 = torch.randn(batch, c_in, size, size, generator=gen, dtype=torch.float64)
    w64 = torch.randn(c_out, c_in, k, k, generator=gen, dtype=torch.float64) / (c_in * k * k) ** 0.5
    b64 = torch.randn(c_out, generator=gen, dtype=torch.float64)
    s64 = torch.rand(batch, c_in, 1, 1, generator=gen, dtype=torch.float64) + 0.5 if scaled else None
    torch_act = {"relu": F.relu, "silu": F.silu, "hardswish": F.hardswish, "none": lambda t: t}[act]
    epilogue = Epilogue(act=Activation[act.upper()])
    ref = torch_act(F.conv2d(x64 * s64 if scaled else x64, w64, b64, stride, pad))
    x = x64.to("cuda", dtype).contiguous(memory_format=torch.channels_last)
    scale = s64.to("cuda", dtype) if scaled else None
    w_cl = w64.to("cuda", dtype).contiguous(memory_format=torch.channels_last)
    b_cl = b64.to("cuda", dtype)
    cudnn = lambda: torch_act(F.conv2d(x * scale if scaled else x, w_cl, b_cl, stride, pad))
    row: dict[str, Any] = {"layer": name, "batch": batch, "dtype": dtype_name, "cudnn_ms": do_bench_ms(cudnn)}
    row["order"] = conv_choice.conv_kernel(c_in, c_out, 1, (k, k), (stride, stride), pad).value  # unprefixed labels'
    packed = pack_conv_weight(w64.to("cuda", dtype), precision)
    bias32 = b64.float().cuda()
    oh = (size + 2 * pad - k) // stride + 1
    out = torch.empty(batch, c_out, oh, oh, device="cuda", dtype=dtype).contiguous(memory_format=torch.channels_last)
    orders = reduction_orders(name, c_in, k)
    shipped = shipped_routing()

    def plan(tile: Any, order: tuple[float, ...]) -> Any:
        conv._plans._plans.clear()  # plans are keyed by the call, not by the reduction order
        with routed(order):
            return conv.conv2d_act_plan(x, packed, bias32, stride=stride, padding=pad, epilogue=epilogue, out=out,
                                        tile=tile, input_scale=scale)  # fmt: skip

    def timed(run: Any) -> dict[str, Any]:
        out.fill_(float("nan"))
        run()
        err = float((out.double().cpu() - ref).norm() / ref.norm())
        return {"ms": do_bench_ms(run), "rel_error": err}

    call = lambda p: lambda: p(x, packed.data, bias32, None, out, scale)
    chosen_before = set(autotune._memory)  # the default's choice is the one entry its plan adds
    row["default"] = timed(call(plan(None, shipped)))
    if k > 1 and stride == 1 and 2 * pad == k - 1:  # what a shifted-tap launch spends copying into the bordered buffer
        row["bordered_copy_ms"] = do_bench_ms(lambda: bordered_copy(x, pad, pad))
    added = [choice.config for key, choice in autotune._memory.items() if key not in chosen_before]
    row["default"]["config"] = asdict(added[-1]) if added else None
    configs: dict[str, Any] = {}
    x_shape = (batch, c_in, size, size)
    for order, routing in orders.items():
        with routed(routing):
            candidates = conv.conv2d_tile_candidates(x_shape, packed, stride, (pad,) * 4)
            kernel = conv_choice.conv_kernel(c_in, c_out, 1, (k, k))
        if kernel == conv_choice.ConvKernel.DIRECT:
            extras = direct_tiles(c_out)
        elif kernel == conv_choice.ConvKernel.IMPLICIT_GEMM_FLAT_K and c_in >= conv_choice.FLAT_K_BELOW:
            # flat K for padded blocks: row tiles only
            extras = [*conv.persistent_variants(candidates, SWEEP_PER_SM), *flat_k_tiles(c_out, x.element_size())]
        else:
            extras = [
                *extra_tiles(c_in, c_out, k, stride, x.element_size()),
                *conv.persistent_variants(candidates, SWEEP_PER_SM),
            ]
        for tile in dict.fromkeys([*candidates, *extras]):
            label = f"{order}{'-' if order else ''}{tile.block_m}x{tile.block_n}x{tile.block_k}w{tile.num_warps}" + (
                f"s{tile.num_stages}"
                + (f"k{tile.split_k}" if tile.split_k > 1 else "")
                + (f"b{tile.box_w}" if tile.box_w else "")
                + (f"sk{tile.stream_k}" if tile.stream_k else "")
                + ("t" if tile.tap_shift else "")
                + (f"p{tile.persistent}" if tile.persistent else "")
            )
            try:
                configs[label] = timed(call(plan(tile, routing)))
            except Exception as error:  # a tile that does not compile or fit is a finding, not a stop
                configs[label] = {"error": f"{type(error).__name__}: {error}"[:200]}
    row["configs"] = configs
    ok = {n: v["ms"] for n, v in configs.items() if "ms" in v}
    row["best"] = min(ok, key=ok.get) if ok else None
    return row


# layer_row's labels; a trailing "t" marks shifted taps: over the zero-bordered input where the row records
# bordered_copy_ms, else the masked kind of results/conv-tile-sweep-2026-12-03c.json, which cache_entries leaves out
LABEL = re.compile(r"(\d+)x(\d+)x(\d+)w(\d+)s(\d+)(?:k(\d+))?(?:b(\d+))?(?:sk(\d+))?(t)?(?:p(\d+))?")


def cache_entries(result: dict[str, Any], groups: tuple[str, ...] = ("late", "rgb")) -> list[dict[str, Any]]:
    """The rows of a ``conv-tile-sweep.json`` of the layer ``groups`` as autotune cache entries (kernel, problem,
    every forced config's time), which ``fuser.kernels.tile_table.build_table`` ranks: what ``benchmarks.tile_table
    --from-sweep`` adds to the shipped table. A config that failed to run, or whose output was beyond the
    precision's tolerance of float64, counts as not running. Rows of other groups, configs labelled with a
    reduction order (the stem's), the masked shifted taps of sweeps before the bordered input (rows without
    ``bordered_copy_ms``), and rows whose unprefixed labels ran in another reduction order than the shipped routing
    gives the layer now (``order``; rows of sweeps before it was recorded ran without ``FLAT_K_PAD_ABOVE``) are left
    out: their configs named other kernels."""
    from fuser.kernels.autotune import TileConfig
    from fuser.kernels.conv_choice import ConvKernel, conv_kernel
    from fuser.verification import TOLERANCE

    def order_before_recorded(c_in: int, c_out: int, k: int, stride: int, pad: int) -> str:
        with routed(rerouted(FLAT_K_PAD_ABOVE=1.0)):
            return conv_kernel(c_in, c_out, 1, (k, k), (stride, stride), pad).value

    layers = {layer[0]: layer for group in groups for layer in LAYERS[group]}
    precision = {dtype: prec for _, dtype, prec in REGIMES.values()}  # as layer_row packed the weights
    entries = []
    for row in result["rows"]:
        if row["layer"] not in layers:
            continue
        _, c_in, c_out, k, stride, pad, size, _, _ = layers[row["layer"]]
        kernel = conv_kernel(c_in, c_out, 1, (k, k), (stride, stride), pad)
        ran = row["order"] if "order" in row else order_before_recorded(c_in, c_out, k, stride, pad)
        if ran != kernel.value:
            continue
        name = {ConvKernel.GEMM_1X1: "gemm_act", ConvKernel.DIRECT: "direct_conv_act"}.get(kernel, "conv2d_act")
        group_m = 1 if kernel == ConvKernel.DIRECT else 8  # as direct_candidates / the GEMM candidates list them
        oh = (size + 2 * pad - k) // stride + 1
        prec, elem = precision[row["dtype"]], getattr(torch, row["dtype"]).itemsize
        timings = []
        for label, measured in row["configs"].items():
            match = LABEL.fullmatch(label)
            if match is None or (match[9] and "bordered_copy_ms" not in row):
                continue
            bm, bn, bk, warps, stages, split, box, stream = (int(g) if g else 0 for g in match.groups()[:8])
            shift, persistent = int(bool(match[9])), int(match[10] or 0)
            config = TileConfig(bm, bn, bk, group_m, warps, stages, split or 1, box, stream, shift, persistent)
            right = measured.get("rel_error") is not None and measured["rel_error"] < TOLERANCE[prec]
            timings.append([asdict(config), measured.get("ms") if right else None])
        problem = {"m": row["batch"] * oh * oh, "n": c_out, "k": c_in * k * k, "groups": 1, "operand_bytes": elem,
                   "precision": prec}  # fmt: skip
        entries.append({"kernel": name, "problem": problem, "timings_ms": timings})
    return entries


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--budget-s", type=float, default=200.0)
    parser.add_argument("--only", default="stem,narrow", help="layer groups, comma-separated")
    parser.add_argument("--layers", help="comma-separated layer names: only these of the groups")
    parser.add_argument("--regimes", default="32:float16,1:float32", help=f"comma-separated, of {', '.join(REGIMES)}")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    from benchmarks.gpu_models import versions

    start = time.perf_counter()
    header = {"benchmark": "conv_tile_sweep", "date": time.strftime("%Y-%m-%d"),
              "card": torch.cuda.get_device_name(), "versions": versions()}  # fmt: skip
    rows = []
    for batch, dtype_name, precision in (REGIMES[name] for name in args.regimes.split(",")):
        for group in args.only.split(","):
            for layer in LAYERS[group]:
                if args.layers and layer[0] not in args.layers.split(","):
                    continue
                if time.perf_counter() - start > args.budget_s:
                    break
                row = layer_row(layer, batch, dtype_name, precision)
                rows.append(row)
                (args.out / "conv-tile-sweep.json").write_text(json.dumps({**header, "rows": rows}, indent=1))
                worst = max((v.get("rel_error", 0.0) for v in row["configs"].values()), default=0.0)
                best = row["configs"][row["best"]]["ms"] if row["best"] else float("nan")
                print(
                    f"{row['layer']:24s} b{batch:<2d} {dtype_name[:5]}: cudnn {row['cudnn_ms'] * 1e3:7.1f} default "
                    f"{row['default']['ms'] * 1e3:7.1f} best {best * 1e3:7.1f} us ({row['best']}) max err {worst:.1e}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
