"""One conv layer of benchmarks/layers.py launched a few times with its untuned default tile, for Nsight Compute
to read what its kernel waits on: kernels/NOTES.md version 17 found the fp16 RGB stem at 4.8x the time its FMAs
need and 64->64 @80 at 3x its floor, and neither answers to tile shape, so the next step is the stall reasons.

    python -m benchmarks.stall_profile --layer "yolo 3->16 3x3 s2 @640" --dtype fp16 [--batch 32] [--calls 5]
    bash benchmarks/device_profile.sh      # both layers under ncu on the GPU machine, the reports in $OUT

Prints the tile each launch took, so that a report can be matched with the tile table. ``--interpret`` runs the
same launches in Triton's interpreter on the CPU at a small size (a check of this script, no figures).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from benchmarks.layers import OTHERS, YOLO, ConvLayer, conv_block, fold_bn

LAYERS = {layer.name: layer for layer in (*YOLO, *OTHERS)}
DTYPES = {"fp32": (torch.float32, "tf32"), "fp16": (torch.float16, "fp16")}


@dataclass
class Launched:
    """What :func:`launches` ran: the input, the folded float64 weight and bias, the last output, the tiles."""

    x: torch.Tensor
    weight64: torch.Tensor
    bias64: torch.Tensor
    out: torch.Tensor
    tiles: list[str]


def fused_layer(
    layer: ConvLayer, dtype_name: str, batch: int, interpret: bool = False, act: str = "SILU"
) -> tuple[Callable[[], torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(call, x, weight64, bias64)``: ``call()`` launches ``layer``'s fused conv -> BN -> ``act`` (an
    :class:`Activation` name; BN statistics randomized, folded in float64) on the channels_last input ``x``."""
    from fuser.kernels import Activation, Epilogue, conv2d_act, pack_conv_weight

    dtype, precision = DTYPES[dtype_name]
    device = "cpu" if interpret else "cuda"
    with torch.no_grad():
        w64, b64 = fold_bn(conv_block(layer, torch.float32, device))
    packed = pack_conv_weight(w64.float(), precision, groups=layer.groups)
    bias = b64.float()
    x = torch.randn(batch, layer.c_in, layer.size, layer.size, device=device).to(dtype)
    x = x.contiguous(memory_format=torch.channels_last)
    epilogue = Epilogue(Activation[act])

    def call() -> torch.Tensor:
        with torch.no_grad():
            return conv2d_act(x, packed, bias, stride=layer.stride, padding=layer.padding, epilogue=epilogue,
                              interpret=interpret)  # fmt: skip

    return call, x, w64, b64


def launches(layer: ConvLayer, dtype_name: str, batch: int, calls: int, interpret: bool = False) -> Launched:
    """``calls`` launches of ``layer``'s fused conv -> BN -> SiLU (:func:`fused_layer`); the tiles are each chosen
    plan's, as the autotune memory records it."""
    call, x, w64, b64 = fused_layer(layer, dtype_name, batch, interpret)
    out, chosen = first_call_tiles(call)
    for _ in range(calls - 1):
        out = call()
    if not interpret:
        torch.cuda.synchronize()
    return Launched(x, w64, b64, out, [f"{key}: {config}" for key, config in chosen])


def first_call_tiles(call: Callable[[], torch.Tensor]) -> tuple[torch.Tensor, list[tuple[str, object]]]:
    """``call()``'s output and the ``(key, tile config)`` of each plan it chose (the autotune memory's new entries)."""
    from fuser.kernels import autotune

    before = set(autotune._memory)
    out = call()
    return out, [(key, choice.config) for key, choice in autotune._memory.items() if key not in before]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layer", required=True, choices=sorted(LAYERS), metavar="NAME", help="a layers.py conv row")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--calls", type=int, default=5, help="launches (ncu: skip the first, profile one)")
    parser.add_argument("--interpret", action="store_true", help="Triton's interpreter on the CPU, size 17")
    parser.add_argument("--size", type=int, help="input size instead of the layer's own")
    args = parser.parse_args()
    layer = LAYERS[args.layer]
    size = args.size or (17 if args.interpret else layer.size)
    layer = ConvLayer(layer.name, layer.c_in, layer.c_out, layer.kernel, layer.stride, size, layer.groups)
    start = time.perf_counter()
    chosen = launches(layer, args.dtype, args.batch, args.calls, args.interpret).tiles
    seconds = time.perf_counter() - start
    print(f"{layer.name} B={args.batch} {args.dtype} size {size}: {args.calls} calls in {seconds:.1f} s")
    for line in chosen or ["the interpreter's fixed tile (kernels choose none there)"]:
        print(f"  tile {line}")


if __name__ == "__main__":
    main()
