"""Box tiles (the activation operand through TMA, kernels/conv_boxes.py) against row tiles (GPU).

    python -m benchmarks.box_tiles --out DIR                   write DIR/box-tiles-<date>.json, print a table
    python -m benchmarks.box_tiles --operands-on-cpu --out DIR  no GPU: where the compiled dot reads A, per box

For every 3x3 layer of the layer benchmark that box tiles can take (benchmarks/layers.py: YOLO and ResNet
shapes) at batch 32 and batch 8, in tf32 and fp16: the row tiles' default (the shipped table's or the cost
model's pick among the row candidates, what optimize() ran before box tiles), every box candidate, and
"cuDNN folded + act" (the layer benchmark's baseline), all timed in the same run as CUDA-graph replay
medians, each with its error against a float64 reference and where its compiled dot reads the activation
operand (``a_operand``, from the TTGIR: "shared" when wgmma reads it from shared memory, "registers" when it
passes through them).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.layers import (
    DTYPES,
    OTHERS,
    PRECISION_OF,
    YOLO,
    bench_all,
    compiled_kernels,
    conv_block,
    fold_bn,
    rel_error,
)


def a_operand(kernels: list) -> str:
    """Where the kernels' Hopper dots (TTGIR ``warp_group_dot``) read their A operand: "shared" (a
    ``!ttg.memdesc``), "registers" (a ``tensor<...>``), or "no wgmma"."""
    kinds = set()
    for kernel in kernels:
        for line in kernel.asm.get("ttgir", "").splitlines():
            # `%d = ttng.warp_group_dot %a, %b, %c {inputPrecision = 0 : i32, ...} : A-type * B-type -> C-type`:
            # the operand types follow the attribute dict, whose own " : " must not be taken for them
            types = re.search(r"warp_group_dot [^{]*(?:\{[^}]*\})?\s*:\s*(.*)", line)
            if types:
                kinds.add("shared" if types[1].startswith("!ttg.memdesc") else "registers")
    return "+".join(sorted(kinds)) or "no wgmma"


# Box shapes for the IR check on the CPU (block_m, box_w): several rows (the candidates' two widths) and one row.
IR_BOXES = {"8 rows x 16": (128, 16), "16 rows x 8": (128, 8), "1 row x 128": (128, 128), "1 row x 64": (64, 64)}


def operands_on_cpu(boxes: dict[str, tuple[int, int]] = IR_BOXES, dtypes=(("fp16", 64), ("fp32", 32))) -> dict:
    """Where the box kernel's dot reads its A operand, per box shape and dtype, from the TTGIR of a compile for
    sm_90 on this machine (no GPU needed; the installed triton's compiler, with its bundled ptxas): the same
    compiler version gives the same TTGIR as on the GPU. ``boxes``: name -> (block_m, box_w); ``dtypes``:
    (dtype, block_k) pairs. The row tiles' pointer gather is listed for comparison."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fuser.kernels import conv

    def compile_one(dtype: str, block_m: int, box_w: int, block_k: int) -> str:
        x = f"tensordesc<{dtype}[1, {block_m // box_w}, 1, {box_w}, {block_k}]>" if box_w else f"*{dtype}"
        out = f"*{dtype}" if box_w else f"tensordesc<{dtype}[{block_m}, 128]>"  # a box's rows: through pointers
        pointers = {"x_ptr": x, "w_ref": f"tensordesc<{dtype}[128, {block_k}]>", "bias_ptr": "*fp32",
                    "res_ptr": f"*{dtype}", "out_ref": out, "ps_ptr": f"*{dtype}", "x2_ptr": f"*{dtype}",
                    "ws_ptr": "*fp32", "count_ptr": "*i32"}  # fmt: skip
        constexprs = {"KH": 3, "KW": 3, "K_ORDER": 0, "HAS_BIAS": True, "ACT": 4, "RESIDUAL": 0, "HAS_SCALE": False,
                      "ROUND_TF32": False, "PROLOGUE": 0, "VIRTUAL_CAT": False, "UP": 1, "DOT_PRECISION": "tf32",
                      "UPCAST": False, "USE_DESC": True, "SPLIT_K": 1, "SPLIT_TAIL": False, "BLOCK_M": block_m,
                      "BLOCK_N": 128, "BLOCK_K": block_k, "GROUP_M": 8, "BOX_W": box_w, "STREAM_K": False,
                      "TAP_SHIFT": False}  # fmt: skip
        kernel = conv._conv2d_act_kernel
        scalar = lambda name: "fp32" if name in ("alpha", "scale") else "i32"
        signature = {
            name: "constexpr" if name in constexprs else pointers.get(name, scalar(name)) for name in kernel.arg_names
        }
        source = ASTSource(kernel, signature, constexprs=constexprs)
        options = {"num_warps": 8 if block_m == 128 else 4, "num_stages": 3}
        return a_operand([triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)])

    result = {"date": dt.date.today().isoformat(), "triton": triton.__version__, "target": "sm_90", "operands": {}}
    for dtype, block_k in dtypes:
        result["operands"][f"{dtype} row tiles (pointer gather)"] = compile_one(dtype, 128, 0, block_k)
        for name, (block_m, box_w) in boxes.items():
            result["operands"][f"{dtype} box {name}"] = compile_one(dtype, block_m, box_w, block_k)
    return result


def layer_rows(layer, batch: int, dtype_name: str) -> dict:
    from fuser.kernels import Activation, Epilogue, conv2d_act, pack_conv_weight
    from fuser.kernels.autotune import Problem, default_config, device_facts
    from fuser.kernels.conv import conv_candidates
    from fuser.kernels.conv_boxes import box_candidates
    from fuser.kernels.conv_choice import reduction_order

    dtype = DTYPES[dtype_name]
    block = conv_block(layer, dtype)
    x = torch.randn(batch, layer.c_in, layer.size, layer.size, device="cuda").to(dtype)
    x_cl = x.to(memory_format=torch.channels_last)
    w64, b64 = fold_bn(block)
    w_fold, b_fold = w64.to(dtype).to(memory_format=torch.channels_last), b64.to(dtype)
    packed = pack_conv_weight(w64.float(), PRECISION_OF[dtype_name])
    b32, silu, pad, stride = b64.float(), Epilogue(Activation.SILU), layer.padding, layer.stride
    oh = layer.out_size()
    m, k = batch * oh * oh, 9 * layer.c_in
    elem = packed.data.element_size()
    rows = conv_candidates(m, layer.c_in, layer.c_out, k, elem, reduction_order(layer.c_in, 3, 3), 3, 3)
    _, arch, sms = device_facts(torch.device("cuda"))
    problem = Problem(m, layer.c_out, k, 1, elem, PRECISION_OF[dtype_name])
    row_default = default_config("conv2d_act", rows, problem, arch, sms)
    configs = {"rows default": row_default}
    for i, config in enumerate(box_candidates(layer.c_in, layer.c_out, oh, stride, elem)):
        configs[f"box {i}"] = config

    def fused(config):
        return lambda: conv2d_act(x_cl, packed, b32, stride=stride, padding=pad, epilogue=silu, tile=config)

    result = {"layer": layer.name, "batch": batch, "dtype": dtype_name, "configs": {}}
    ref = F.silu(F.conv2d(x.double(), w64, b64, stride, pad))
    fns = {"cudnn_folded_act": lambda: F.silu(F.conv2d(x_cl, w_fold, b_fold, stride, pad))}
    with torch.no_grad():
        for name, config in configs.items():
            try:
                out = fused(config)()
                torch.cuda.synchronize()
            except Exception as error:  # a config that does not compile (shared memory, say) is reported
                result["configs"][name] = {"config": vars(config), "error": f"{type(error).__name__}: {error}"[:400]}
                continue
            fns[name] = fused(config)
            result["configs"][name] = {
                "config": vars(config),
                "rel_error": rel_error(out, ref),
                "a_operand": a_operand(compiled_kernels(fns[name])),
            }
        del ref
        times = bench_all(fns)
    result["cudnn_folded_act_ms"] = times.pop("cudnn_folded_act")
    for name, ms in times.items():
        result["configs"][name]["ms"] = ms
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--batches", default="32,8")
    operands_help = "no GPU: compile the box kernel for sm_90 here and write where its dot reads A (operands JSON)"
    parser.add_argument("--operands-on-cpu", action="store_true", help=operands_help)
    args = parser.parse_args(argv)
    if args.operands_on_cpu:
        result = operands_on_cpu()
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"box-operands-{result['date']}-triton{result['triton']}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        for name, where in result["operands"].items():
            print(f"{name:40s} {where}")
        print(f"wrote {path}")
        return 0
    if not torch.cuda.is_available():
        print("box_tiles: needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    layers = [layer for layer in YOLO + OTHERS if layer.kernel == 3 and layer.groups == 1 and layer.c_in >= 16]
    result = {
        "date": dt.date.today().isoformat(),
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "method": "CUDA-graph replay medians (benchmarks.layers.bench_all), best of two interleaved rounds",
        "rows": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"box-tiles-{result['date']}.json"
    for batch in (int(b) for b in args.batches.split(",")):
        for dtype_name in ("fp16", "fp32"):
            for layer in layers:
                row = layer_rows(layer, batch, dtype_name)
                result["rows"].append(row)
                path.write_text(json.dumps(result, indent=1))
                print(short_line(row), flush=True)
    print(f"wrote {path}")
    return 0


def short_line(row: dict) -> str:
    """One row as text: cuDNN's time, the row default's, the best box config's, and their ratios."""
    timed = {name: c for name, c in row["configs"].items() if "ms" in c}
    rows_ms = timed.get("rows default", {}).get("ms", float("nan"))
    boxes = {name: c["ms"] for name, c in timed.items() if name.startswith("box")}
    best = min(boxes, key=boxes.get) if boxes else None
    where = timed[best]["a_operand"] if best else ""
    box_ms = boxes[best] if best else float("nan")
    errors = max((c.get("rel_error", 0.0) for c in timed.values()), default=float("nan"))
    failed = [name for name, c in row["configs"].items() if "error" in c]
    return (
        f"{row['layer']:26s} b{row['batch']:<3d}{row['dtype']:5s} cudnn {row['cudnn_folded_act_ms']:.4f} "
        f"rows {rows_ms:.4f} best {best} ({where}) {box_ms:.4f} (box 0 {boxes.get('box 0', float('nan')):.4f}) "
        f"x rows {rows_ms / box_ms:.2f} x cudnn {row['cudnn_folded_act_ms'] / box_ms:.2f} "
        f"max err {errors:.1e}{' FAILED ' + ','.join(failed) if failed else ''}"
    )


if __name__ == "__main__":
    raise SystemExit(main())
