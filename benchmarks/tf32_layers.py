"""Where a model's TF32 error comes from, on the CPU: the model run as the GPU computes at "tf32"
(fuser.lower.tf32_emulation), layer by layer against float64 (fuser.verify).

    .venv/bin/python -m benchmarks.tf32_layers efficientnet_b0 [--size 224] [--batch 1] [--layers]

The models are those of the GPU benchmark (benchmarks.real_models: random weights, BN statistics
randomized and calibrated), so the numbers compare with its ``rel_error`` rows.

Prints the model-level error against float64 of the original as cuDNN runs it (operands rounded to
nearest) and of fuser's kernels four ways: as they were (activations truncated), with the TF32-rounded
epilogue stores only (fuser.rewrite.tf32_rounding; the inputs no producer rounds stay truncated), with those and
the weights' truncation compensation (what optimize() builds), and with every operand rounded to nearest
(what rounding the A operand inside the kernels would give); with --layers, each run's per-layer table.
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import replace

import torch

import fuser
from benchmarks.real_models import MODELS, build
from fuser.lower.fused_modules import FusedConv2d, FusedLinear
from fuser.lower.tf32_emulation import emulate_tf32
from fuser.verification import output_error, verify


def without(optimized: torch.nn.Module, stores: bool, gains: bool) -> torch.nn.Module:
    """A copy of ``optimized`` without its TF32-rounded stores (``stores``) and/or its truncation gains."""
    plain = copy.deepcopy(optimized)
    for m in plain.modules():
        if isinstance(m, (FusedConv2d, FusedLinear)):
            if stores and m.epilogue.round_tf32:
                m.set_epilogue(replace(m.epilogue, round_tf32=False))
            if gains:
                m.set_tf32_input_gain(None)
    return plain


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=sorted(MODELS))
    parser.add_argument("--size", type=int, default=None, help="input size (default: the model's usual one)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--layers", action="store_true", help="print the per-layer tables")
    args = parser.parse_args()
    torch.set_num_threads(1)
    model, x = build(args.model, args.batch, args.size)
    optimized = fuser.optimize(model, (x,), backend="torch", cuda_graphs=False)
    marked = sum(1 for m in optimized.modules() if isinstance(m, (FusedConv2d, FusedLinear)) and m.epilogue.round_tf32)
    fused = sum(1 for m in optimized.modules() if isinstance(m, (FusedConv2d, FusedLinear)))
    gained = sum(1 for m in optimized.modules() if getattr(m, "tf32_input_gain", None) is not None)
    print(
        f"{args.model} {tuple(x.shape)}: {fused} fused modules, {marked} store TF32-rounded outputs, "
        f"{gained} compensate truncated inputs"
    )

    with torch.no_grad():
        ref = copy.deepcopy(model).double()(x.double())
        with emulate_tf32(model):
            cudnn = model(x)
        fp32 = model(x)
    print(f"  float32 (no TF32)                   {output_error(fp32, ref)[0]:.2e}")
    print(f"  cuDNN tf32 (operands to nearest)    {output_error(cudnn, ref)[0]:.2e}")
    runs = [
        ("fuser, activations truncated", without(optimized, stores=True, gains=True), "truncate"),
        ("fuser, rounded epilogue stores", without(optimized, stores=False, gains=True), "truncate"),
        ("fuser, stores + compensation", optimized, "truncate"),
        ("fuser, every operand to nearest", without(optimized, stores=False, gains=True), "nearest"),
    ]
    for label, module, activations in runs:
        with emulate_tf32(module, activations):
            result = verify(model, module, (x,), layers=args.layers)
        print(f"  {label:<36}{result.rel_error:.2e}")
        if args.layers:
            print(result)


if __name__ == "__main__":
    main()
