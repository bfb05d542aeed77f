"""The ``fuser`` command line: ``fuser explain MODEL``, ``fuser optimize MODEL -o OUT``, ``fuser verify MODEL``
and ``fuser tune MODEL``.

MODEL is an .onnx file or the name of a bundled reference model (``fuser explain resnet50``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from fuser.kernels.precision import Precision
from fuser.lower.ops import BACKENDS

_ONNX_DTYPES = {
    1: torch.float32,
    10: torch.float16,
    11: torch.float64,
    16: torch.bfloat16,
    6: torch.int32,
    7: torch.int64,
}


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        shape = tuple(int(d) for d in text.replace("x", ",").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a shape: {text!r} (write it like 1,3,224,224)") from None
    if not shape or any(d < 1 for d in shape):
        raise argparse.ArgumentTypeError(f"not a shape: {text!r} (every dimension must be >= 1)")
    return shape


def _load(model: str, shapes: list[tuple[int, ...]] | None, device: str) -> tuple[Any, tuple[torch.Tensor, ...]]:
    """The model to optimize (a path, or a built reference model) and random example inputs for it."""
    from fuser import models

    generator = torch.Generator().manual_seed(0)
    if model in models.MODELS:
        module = models.build(model).to(device)
        if shapes:
            inputs = tuple(torch.randn(s, generator=generator) for s in shapes)
        else:
            inputs = (models.example_input(model, batch=1),)
        return module, tuple(t.to(device) for t in inputs)
    path = Path(model)
    if not path.exists():
        known = ", ".join(models.MODELS)
        raise SystemExit(f"fuser: {model}: no such file, and not a bundled model ({known})")
    if shapes:
        return path, tuple(torch.randn(s, generator=generator).to(device) for s in shapes)
    return path, _onnx_example_inputs(path, generator, device)


def _onnx_example_inputs(path: Path, generator: torch.Generator, device: str) -> tuple[torch.Tensor, ...]:
    """Random inputs shaped like the ONNX graph's inputs (symbolic dimensions, such as the batch, as 1)."""
    import onnx

    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as error:
        raise SystemExit(f"fuser: {path}: not a readable ONNX file ({type(error).__name__}: {error})") from error
    initializers = {i.name for i in proto.graph.initializer}
    inputs = []
    for value in proto.graph.input:
        if value.name in initializers:
            continue
        tensor_type = value.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") and d.dim_value > 0 else 1 for d in tensor_type.shape.dim]
        dtype = _ONNX_DTYPES.get(tensor_type.elem_type, torch.float32)
        t = torch.randn(shape, generator=generator) if dtype.is_floating_point else torch.ones(shape)
        inputs.append(t.to(dtype).to(device))
    return tuple(inputs)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", help="an .onnx file, or a bundled model name (e.g. resnet50, yolov8n)")
    parser.add_argument(
        "--input-shape",
        type=_parse_shape,
        action="append",
        metavar="N,C,H,W",
        help="shape of a random example input (repeat for several inputs); default: from the model",
    )
    parser.add_argument("--precision", default="tf32", choices=[p.value for p in Precision])
    parser.add_argument("--backend", default="auto", choices=BACKENDS)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fuser", description="Fuse conv->BN->activation and GEMM->epilogue chains of a PyTorch or ONNX model."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    explain = sub.add_parser("explain", help="print what would be fused, what not, and why")
    _common(explain)
    explain.add_argument("--json", action="store_true", help="print the report as JSON")
    optimize = sub.add_parser("optimize", help="optimize a model and write it out")
    _common(optimize)
    optimize.add_argument(
        "-o", "--output", required=True, type=Path, help="out.onnx (standard ONNX) or out.pt (torch.save of the module)"
    )
    optimize.add_argument("--opset", type=int, default=None, help="ONNX opset of the output (default: torch's)")
    verify = sub.add_parser("verify", help="optimize a model and check it against a float64 run of the original")
    _common(verify)
    verify.add_argument("--budget", type=float, default=None, help="relative error allowed (default: by precision)")
    verify.add_argument("--plot", type=Path, default=None, metavar="PNG", help="draw the error per fused layer")
    verify.add_argument("--json", action="store_true", help="print the result as JSON")
    sub.add_parser("demo", help="optimize a bundled model and show what it did (same as `make demo`)")
    tune = sub.add_parser(
        "tune",
        help="measure the kernels' tile configurations for a model's shapes on this GPU and cache them on disk",
    )
    _common(tune)
    tune.add_argument("--cache-dir", type=Path, default=None, help="where to cache them (default: $FUSER_CACHE_DIR)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import fuser

    if args.command == "demo":
        from fuser import demo

        return demo.main()
    if args.command == "tune":
        return _tune(args)
    model, inputs = _load(args.model, args.input_shape, args.device)
    if args.command == "verify":
        return _verify(model, inputs, args)
    if args.command == "explain":
        report = fuser.explain(model, inputs, precision=args.precision, backend=args.backend)
        print(json.dumps(report.to_dict(), indent=2) if args.json else report)
        return 0
    suffix = args.output.suffix.lower()
    if suffix not in (".onnx", ".pt", ".pth"):
        raise SystemExit(f"fuser: -o {args.output}: write .onnx or .pt")
    optimized = fuser.optimize(model, inputs, precision=args.precision, backend=args.backend)
    print(optimized.fusion_report)
    if suffix == ".onnx":
        fuser.export_onnx(optimized, inputs, args.output, opset=args.opset)
    else:
        torch.save(optimized, args.output)
    print(f"\nwrote {args.output}")
    return 0


def _verify(model: Any, inputs: tuple[torch.Tensor, ...], args: argparse.Namespace) -> int:
    """Exit status 0 when the optimized model is within the budget, 1 when not."""
    import fuser

    optimized = fuser.optimize(model, inputs, precision=args.precision, backend=args.backend)
    original = model
    if not isinstance(model, torch.nn.Module):  # an ONNX file: its graph as imported, before fusion
        from fuser.onnx.importer import import_onnx

        original = import_onnx(model)
    result = fuser.verify(original, optimized, inputs, budget=args.budget)
    print(json.dumps(result.to_dict(), indent=2) if args.json else result)
    if args.plot is not None:
        print(f"\nwrote {result.plot(args.plot)}")
    return 0 if result.ok else 1


def _tune(args: argparse.Namespace) -> int:
    """``optimize(..., tune=True)`` on the model's example inputs: every launch signature they reach is
    measured (progress on stderr) and cached, so later ``optimize`` calls of those shapes measure nothing."""
    import fuser
    from fuser.kernels import autotune

    if not str(args.device).startswith("cuda"):
        raise SystemExit(f"fuser tune: measuring tile configurations needs a CUDA GPU, but --device is {args.device}")
    if args.backend not in ("auto", "triton", "measured"):
        raise SystemExit(f"fuser tune: --backend {args.backend} runs no compiled kernels, so there is nothing to tune")
    if args.cache_dir is not None:
        autotune.set_cache_dir(args.cache_dir)
    model, inputs = _load(args.model, args.input_shape, args.device)
    optimized = fuser.optimize(model, inputs, precision=args.precision, backend=args.backend, tune=True)
    print(f"{len(optimized.fusion_report.fused)} fused layers; tile choices cached in {autotune.cache_dir()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
