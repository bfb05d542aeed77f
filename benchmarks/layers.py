"""Layer benchmark of the fused kernels against what a user would otherwise run (GPU).

    python -m benchmarks.layers --out DIR [--quick]     measure, write DIR/layers-<date>.json
    python -m benchmarks.layers --table RESULTS.json    print the markdown table (benchmarks/results/layers.md)
    python -m benchmarks.layers --plot RESULTS.json PNG speedup plot (log scale)

Each conv row: conv -> BN (eval, randomized statistics) -> SiLU as eager PyTorch in NCHW and in
channels_last (3 kernels), BN folded into cuDNN + a separate SiLU (2 kernels), torch.compile with
freezing (batch 32 only: each compile costs 5-20 s of GPU time), the fused kernel, and the roofline
floor max(FLOPs / measured matmul ceiling, bytes / measured copy bandwidth), the ceilings measured in
the same run. Each linear row: eager linear + activation, the matmul alone (cuBLAS, no bias, no
activation), torch.compile, the fused kernel. Times are triton.testing.do_bench_cudagraph medians on random
data, each the best of two interleaved rounds; TF32 is allowed for cuBLAS/cuDNN and cudnn.benchmark is
on. The fused output's error against a
float64 reference is recorded with every row.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class ConvLayer:
    name: str
    c_in: int
    c_out: int
    kernel: int
    stride: int
    size: int
    groups: int = 1

    @property
    def padding(self) -> int:
        return self.kernel // 2

    def out_size(self) -> int:
        return (self.size + 2 * self.padding - self.kernel) // self.stride + 1


@dataclass(frozen=True)
class LinearLayer:
    m: int
    k: int
    n: int
    act: str  # "gelu" | "silu"


YOLO = [
    ConvLayer("yolo 3->16 3x3 s2 @640", 3, 16, 3, 2, 640),
    ConvLayer("yolo 16->32 3x3 s2 @320", 16, 32, 3, 2, 320),
    ConvLayer("yolo 64->64 3x3 s1 @80", 64, 64, 3, 1, 80),
    ConvLayer("yolo 128->128 1x1 s1 @40", 128, 128, 1, 1, 40),
    ConvLayer("yolo 256->256 3x3 s1 @20", 256, 256, 3, 1, 20),
    ConvLayer("yolo 64->128 3x3 s2 @160", 64, 128, 3, 2, 160),
    # the detect head's class branch: slower than cuDNN at batch 32 in conv-tile-sweep-2026-12-04c.json (NOTES v20)
    ConvLayer("yolo head 80->80 3x3 s1 @80", 80, 80, 3, 1, 80),
]
OTHERS = [
    ConvLayer("effnet 24->144 1x1 @56", 24, 144, 1, 1, 56),
    ConvLayer("effnet 144->24 1x1 @56", 144, 24, 1, 1, 56),
    ConvLayer("effnet 672->112 1x1 @14", 672, 112, 1, 1, 14),
    ConvLayer("effnet dw 144 3x3 @56", 144, 144, 3, 1, 56, groups=144),
    ConvLayer("resnet 512->512 3x3 @7", 512, 512, 3, 1, 7),
]
LINEARS = [
    LinearLayer(8192, 4096, 16384, "gelu"),
    LinearLayer(8192, 4096, 4096, "silu"),
    LinearLayer(16, 4096, 16384, "gelu"),
    LinearLayer(128, 768, 3072, "gelu"),
]
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
PRECISION_OF = {"fp32": "tf32", "fp16": "fp16", "bf16": "bf16"}


def bench_ms(fn) -> float:
    """Median ms of ``fn`` replayed from a CUDA graph (as models run with graphs on both sides; plain
    launches would time the host's launch cost on batch-1 layers), plain launches where it cannot be
    captured."""
    import triton.testing

    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=10, return_mode="median"))  # 10 replays of 10 ms
    except RuntimeError:
        return float(triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"))


def bench_all(fns: dict[str, object], rounds: int = 2) -> dict[str, float]:
    """Each variant's best median over ``rounds`` interleaved rounds: clocks and neighbours on a shared
    machine drift between measurements, and interleaving gives every variant the same drift."""
    best = {name: math.inf for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            best[name] = min(best[name], bench_ms(fn))
    return best


def check_then_time(calls: dict[str, Callable[[], torch.Tensor]], ref: torch.Tensor, row: dict) -> list[dict]:
    """One row per variant in ``calls`` (``row``'s fields plus ``variant``): its relative error against the float64
    ``ref``, or the error it raised (a config the card or the compiler refuses is a result, not a crash); then the
    variants that ran are timed interleaved (:func:`bench_all`, three rounds) and each row gets its ``ms``."""
    rows, runnable = [], {}
    for name, call in calls.items():
        result = {**row, "variant": name}
        try:
            with torch.no_grad():
                result["rel_error"] = float((call().double() - ref).norm() / ref.norm())
        except Exception as error:
            result["error"] = f"{type(error).__name__}: {error}"[:300]
        else:
            runnable[name] = call
        rows.append(result)
    ms = bench_all(runnable, rounds=3)
    for result in rows:
        if result["variant"] in ms:
            result["ms"] = ms[result["variant"]]
    return rows


def host_us(fn, calls: int = 200) -> float:
    """CPU microseconds to enqueue one call (launcher + framework overhead), GPU work not waited for."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def compiled_kernels(fn) -> list:
    """Triton's compiled kernels that one call of ``fn`` launches (every compiled launch of fuser's conv and GEMM
    kernels, the Gluon halo conv's included, goes through ``LaunchOptions.launch``, which returns Triton's compiled
    kernel)."""
    from fuser.kernels.launch import LaunchOptions

    seen, real = [], LaunchOptions.launch

    def recording(self, *args, **kwargs):
        seen.append(real(self, *args, **kwargs))
        return seen[-1]

    LaunchOptions.launch = recording
    try:
        fn()
    finally:
        LaunchOptions.launch = real
    return [k for k in seen if k is not None]


def mma_kind(fn) -> str:
    """Which matrix instructions the fused kernel's PTX holds: 'wgmma' (Hopper), 'mma' (Ampere-style) or
    'none' (CUDA-core FMA only), read from the compiled kernels one call launches."""
    ptx = " ".join(k.asm["ptx"] for k in compiled_kernels(fn))
    return "wgmma" if "wgmma.mma_async" in ptx else "mma" if "mma.sync" in ptx else "none"


def measure_ceilings() -> dict[str, float]:
    """Matmul TFLOP/s per dtype (8192^3, cuBLAS) and device copy bandwidth (bytes read + written)."""
    n = 8192
    ceilings = {}
    for name, dtype in DTYPES.items():
        a = torch.randn(n, n, device="cuda", dtype=dtype)
        b = torch.randn(n, n, device="cuda", dtype=dtype)
        ms = bench_ms(lambda a=a, b=b: torch.mm(a, b))
        ceilings[f"matmul_tflops_{name}"] = 2 * n**3 / ms / 1e9
        del a, b
    src = torch.randn(512 * 2**20, device="cuda")  # 2 GiB
    dst = torch.empty_like(src)
    ms = bench_ms(lambda src=src, dst=dst: dst.copy_(src))
    ceilings["copy_tb_s"] = 2 * src.numel() * 4 / ms / 1e9
    del src, dst
    torch.cuda.empty_cache()
    return ceilings


def floor_ms(flops: float, nbytes: float, dtype: str, ceilings: dict[str, float]) -> float:
    compute = flops / (ceilings[f"matmul_tflops_{dtype}"] * 1e9)
    memory = nbytes / (ceilings["copy_tb_s"] * 1e9)
    return max(compute, memory)


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return math.inf
    return ((out64 - ref64).norm() / ref64.norm()).item()


def conv_block(layer: ConvLayer, dtype: torch.dtype, device: str = "cuda") -> torch.nn.Sequential:
    from fuser.models.common import randomize_batchnorm

    conv = torch.nn.Conv2d(
        layer.c_in, layer.c_out, layer.kernel, layer.stride, layer.padding, groups=layer.groups, bias=False
    )
    block = torch.nn.Sequential(conv, torch.nn.BatchNorm2d(layer.c_out), torch.nn.SiLU())
    randomize_batchnorm(block)
    return block.eval().to(device, dtype)


def fold_bn(block: torch.nn.Sequential) -> tuple[torch.Tensor, torch.Tensor]:
    """The conv weight and bias with BN folded in, computed in float64."""
    conv, bn = block[0], block[1]
    scale = bn.weight.double() / torch.sqrt(bn.running_var.double() + bn.eps)
    w = conv.weight.double() * scale[:, None, None, None]
    b = bn.bias.double() - bn.running_mean.double() * scale
    return w, b


def compiled(module: torch.nn.Module, example: torch.Tensor):
    import torch._inductor.config as inductor_config

    inductor_config.freezing = True
    torch._dynamo.reset()
    fn = torch.compile(module)
    start = time.perf_counter()
    fn(example)
    torch.cuda.synchronize()
    return fn, time.perf_counter() - start


def conv_row(layer: ConvLayer, batch: int, dtype_name: str, ceilings: dict[str, float], use_compile: bool) -> dict:
    from fuser.kernels import Activation, Epilogue, conv2d_act, pack_conv_weight

    dtype = DTYPES[dtype_name]
    block = conv_block(layer, dtype)
    x = torch.randn(batch, layer.c_in, layer.size, layer.size, device="cuda").to(dtype)
    x_cl = x.to(memory_format=torch.channels_last)
    block_cl = copy.deepcopy(block).to(memory_format=torch.channels_last)
    w64, b64 = fold_bn(block)
    w_fold = w64.to(dtype).to(memory_format=torch.channels_last)
    b_fold = b64.to(dtype)
    packed = pack_conv_weight(w64.float(), PRECISION_OF[dtype_name], groups=layer.groups)
    b32 = b64.float()
    silu = Epilogue(Activation.SILU)
    pad = layer.padding

    def fused():
        return conv2d_act(x_cl, packed, b32, stride=layer.stride, padding=pad, epilogue=silu)

    row = {"kind": "conv", "layer": layer.name, "batch": batch, "dtype": dtype_name}
    with torch.no_grad():
        t0 = time.perf_counter()
        out = fused()  # first call measures the tile candidates
        torch.cuda.synchronize()
        row["fused_first_call_s"] = time.perf_counter() - t0
        row["fused_mma"] = mma_kind(fused)
        ref = F.silu(F.conv2d(x.double(), w64, b64, layer.stride, pad, 1, layer.groups))
        row["fused_rel_error"] = rel_error(out, ref)
        del ref
        variants = {
            "fused_ms": fused,
            "eager_nchw_ms": lambda: block(x),
            "eager_cl_ms": lambda: block_cl(x_cl),
            "cudnn_folded_act_ms": lambda: F.silu(F.conv2d(x_cl, w_fold, b_fold, layer.stride, pad, 1, layer.groups)),
            # the conv kernel alone (no bias, no activation): what fuser's kernel does beyond it is its epilogue
            "cudnn_conv_alone_ms": lambda: F.conv2d(x_cl, w_fold, None, layer.stride, pad, 1, layer.groups),
        }
        if use_compile:
            fn, row["compile_s"] = compiled(block_cl, x_cl)
            variants["torch_compile_ms"] = lambda: fn(x_cl)
        row.update(bench_all(variants))
        row["fused_host_us"] = host_us(fused)
        row["eager_cl_host_us"] = host_us(variants["eager_cl_ms"])
    oh = layer.out_size()
    size = x.element_size()
    flops = 2 * batch * oh * oh * layer.c_out * (layer.c_in // layer.groups) * layer.kernel**2
    nbytes = size * (x.numel() + batch * layer.c_out * oh * oh + w_fold.numel())
    row["floor_ms"] = floor_ms(flops, nbytes, dtype_name, ceilings)
    return row


def linear_row(layer: LinearLayer, dtype_name: str, ceilings: dict[str, float], use_compile: bool) -> dict:
    from fuser.kernels import Activation, Epilogue, gemm_act, pack_gemm_weight

    dtype = DTYPES[dtype_name]
    act = {"gelu": F.gelu, "silu": F.silu}[layer.act]
    lin = torch.nn.Linear(layer.k, layer.n).cuda().to(dtype).eval()
    module = torch.nn.Sequential(lin, torch.nn.GELU() if layer.act == "gelu" else torch.nn.SiLU())
    a = torch.randn(layer.m, layer.k, device="cuda").to(dtype)
    packed = pack_gemm_weight(lin.weight.float(), PRECISION_OF[dtype_name])
    b32 = lin.bias.float()
    epilogue = Epilogue(Activation.GELU if layer.act == "gelu" else Activation.SILU)
    w_t = lin.weight.t()

    def fused():
        return gemm_act(a, packed, b32, epilogue=epilogue)

    row = {
        "kind": "linear",
        "layer": f"linear {layer.m}x{layer.k}x{layer.n} {layer.act}",
        "batch": layer.m,
        "dtype": dtype_name,
    }
    with torch.no_grad():
        t0 = time.perf_counter()
        out = fused()
        torch.cuda.synchronize()
        row["fused_first_call_s"] = time.perf_counter() - t0
        row["fused_mma"] = mma_kind(fused)
        ref = act(a.double() @ lin.weight.double().t() + lin.bias.double())
        row["fused_rel_error"] = rel_error(out, ref)
        del ref, out
        variants = {
            "fused_ms": fused,
            "eager_ms": lambda: act(lin(a)),
            "matmul_alone_ms": lambda: torch.mm(a, w_t),
        }
        if use_compile:
            fn, row["compile_s"] = compiled(module, a)
            variants["torch_compile_ms"] = lambda: fn(a)
        row.update(bench_all(variants))
        row["fused_host_us"] = host_us(fused)
        row["eager_host_us"] = host_us(variants["eager_ms"])
    size = a.element_size()
    flops = 2 * layer.m * layer.k * layer.n
    nbytes = size * (layer.m * layer.k + layer.k * layer.n + layer.m * layer.n)
    row["floor_ms"] = floor_ms(flops, nbytes, dtype_name, ceilings)
    return row


def add_ratios(row: dict) -> None:
    fused = row["fused_ms"]
    for base in (
        "eager_nchw_ms",
        "eager_cl_ms",
        "cudnn_folded_act_ms",
        "cudnn_conv_alone_ms",
        "torch_compile_ms",
        "eager_ms",
        "matmul_alone_ms",
    ):
        if base in row:
            row[f"speedup_vs_{base[:-3]}"] = row[base] / fused
    row["fused_over_floor"] = fused / row["floor_ms"]


def plan(quick: bool) -> list[tuple]:
    """Rows in order of importance (results are written after each row, so a time limit keeps the first).

    torch.compile runs on batch-32 conv rows (fp16 only for the YOLO shapes) and on the linear rows.
    """
    rows: list[tuple] = []
    for dtype in ("fp32", "fp16"):
        rows += [("conv", layer, 32, dtype, True) for layer in YOLO]
    for dtype in ("fp32", "bf16"):
        rows += [("linear", layer, layer.m, dtype, True) for layer in LINEARS]
    rows += [("conv", layer, 32, "fp32", True) for layer in OTHERS]
    rows += [("conv", layer, 32, "fp16", False) for layer in OTHERS]
    if quick:
        return rows
    for dtype in ("fp32", "fp16"):
        rows += [("conv", layer, 1, dtype, False) for layer in YOLO + OTHERS]
    return rows


def run(out_dir: Path, quick: bool, no_compile: bool, only: list[str] | None = None) -> Path:
    import triton

    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    date = dt.date.today().isoformat()
    result = {
        "date": date,
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "method": __doc__.strip().splitlines()[5:],
        "ceilings": measure_ceilings(),
        "rows": [],
    }
    path = out_dir / f"layers-{date}.json"
    out_dir.mkdir(parents=True, exist_ok=True)
    print(json.dumps(result["ceilings"]), flush=True)
    for kind, layer, batch, dtype, use_compile in plan(quick):
        name = getattr(layer, "name", str(layer))
        if only and not any(part in f"{name} B={batch} {dtype}" for part in only):
            continue
        try:
            if kind == "conv":
                row = conv_row(layer, batch, dtype, result["ceilings"], use_compile and not no_compile)
            else:
                row = linear_row(layer, dtype, result["ceilings"], use_compile and not no_compile)
            add_ratios(row)
        except Exception as err:  # one failing row must not lose the others
            row = {
                "kind": kind,
                "layer": getattr(layer, "name", str(layer)),
                "batch": batch,
                "dtype": dtype,
                "error": f"{type(err).__name__}: {err}"[:500],
            }
        result["rows"].append(row)
        path.write_text(json.dumps(result, indent=1))
        print(short_line(row), flush=True)
        torch.cuda.empty_cache()
    return path


def short_line(row: dict) -> str:
    if "error" in row:
        return f"{row['layer']:<34} B={row['batch']:<5} {row['dtype']}  ERROR {row['error'][:120]}"
    base = row.get("eager_cl_ms", row.get("matmul_alone_ms"))
    tc = row.get("torch_compile_ms")
    return (
        f"{row['layer']:<34} B={row['batch']:<5} {row['dtype']}  fused {row['fused_ms']:.4f}  "
        f"base {base:.4f}  compile {tc if tc is None else round(tc, 4)}  floor {row['floor_ms']:.4f}  "
        f"err {row['fused_rel_error']:.1e}  host {row['fused_host_us']:.0f} us  {row['fused_mma']}"
    )


def fmt(value: float | None, digits: int = 3) -> str:
    return "" if value is None else f"{value:.{digits}f}"


def table(result: dict) -> str:
    c = result["ceilings"]
    lines = [
        f"# Layer benchmark: {result['gpu']}, torch {result['torch']}, triton {result['triton']}, "
        f"CUDA {result['cuda']}, {result['date']}",
        "",
        f"Ceilings measured in the same run: matmul TF32 {c['matmul_tflops_fp32']:.0f}, fp16 "
        f"{c['matmul_tflops_fp16']:.0f}, bf16 {c['matmul_tflops_bf16']:.0f} TFLOP/s; copy "
        f"{c['copy_tb_s']:.2f} TB/s. Times in ms (CUDA-graph replay medians); x = speedup of the fused kernel "
        "(> 1: fused is faster); floor = max(FLOPs / matmul ceiling, bytes / copy bandwidth); "
        "err = fused output vs float64 reference (||out - ref|| / ||ref||).",
        "",
        "## conv -> BN -> SiLU",
        "",
        "| layer | B | dtype | fused | eager NCHW | eager CL | cuDNN folded + act | cuDNN conv alone | torch.compile "
        "| floor | x eager CL | x cuDNN + act | x compile | fused / floor | err |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        if row["kind"] != "conv":
            continue
        if "error" in row:
            lines.append(
                f"| {row['layer']} | {row['batch']} | {row['dtype']} | error: {row['error'][:80]} |" + " |" * 11
            )
            continue
        lines.append(
            f"| {row['layer']} | {row['batch']} | {row['dtype']} | {fmt(row['fused_ms'])} | "
            f"{fmt(row['eager_nchw_ms'])} | {fmt(row['eager_cl_ms'])} | {fmt(row['cudnn_folded_act_ms'])} | "
            f"{fmt(row.get('cudnn_conv_alone_ms'))} | {fmt(row.get('torch_compile_ms'))} | {fmt(row['floor_ms'])} | "
            f"{fmt(row['speedup_vs_eager_cl'], 2)} | {fmt(row.get('speedup_vs_cudnn_folded_act'), 2)} | "
            f"{fmt(row.get('speedup_vs_torch_compile'), 2)} | "
            f"{fmt(row['fused_over_floor'], 2)} | {row['fused_rel_error']:.1e} |"
        )
    lines += [
        "",
        "## linear -> bias -> activation",
        "",
        "| M x K x N act | dtype | fused | eager | matmul alone | torch.compile | floor | x eager | x matmul "
        "| x compile | err |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        if row["kind"] != "linear":
            continue
        if "error" in row:
            lines.append(f"| {row['layer']} | {row['dtype']} | error: {row['error'][:80]} |" + " |" * 8)
            continue
        lines.append(
            f"| {row['layer'][7:]} | {row['dtype']} | {fmt(row['fused_ms'])} | {fmt(row['eager_ms'])} | "
            f"{fmt(row['matmul_alone_ms'])} | {fmt(row.get('torch_compile_ms'))} | {fmt(row['floor_ms'])} | "
            f"{fmt(row['speedup_vs_eager'], 2)} | {fmt(row['speedup_vs_matmul_alone'], 2)} | "
            f"{fmt(row.get('speedup_vs_torch_compile'), 2)} | {row['fused_rel_error']:.1e} |"
        )
    return "\n".join(lines) + "\n"


# The plot's bar series: (label, the row's speedup key, and for linear rows the key standing in for it).
PLOT_SERIES = [
    ("vs cuDNN with BN folded + act (conv) / the matmul alone (linear): the target", "speedup_vs_cudnn_folded_act",
     "speedup_vs_matmul_alone"),
    ("vs torch.compile (freezing; batch 32 and linear rows)", "speedup_vs_torch_compile", None),
    ("vs eager (channels_last for convs)", "speedup_vs_eager_cl", "speedup_vs_eager"),
]  # fmt: skip


def plot(result: dict, png: Path) -> None:
    """One row per layer, one bar per baseline of :data:`PLOT_SERIES` (a missing baseline draws no bar), log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if "error" not in r]
    labels = [f"{r['layer']} B{r['batch']} {r['dtype']}" for r in rows]
    fig, ax = plt.subplots(figsize=(11, 0.36 * len(rows) + 1.5))
    height = 0.8 / len(PLOT_SERIES)
    for k, (label, key, linear_key) in enumerate(PLOT_SERIES):
        offset = (k - (len(PLOT_SERIES) - 1) / 2) * height
        bars = [(i + offset, r.get(key) or r.get(linear_key or key)) for i, r in enumerate(rows)]
        bars = [(y, value) for y, value in bars if value]
        ax.barh([y for y, _ in bars], [value for _, value in bars], height=height, label=label)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_yticks(list(range(len(rows))), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("speedup of the fused kernel (log scale, > 1 is faster)")
    ax.set_title(f"fuser layer speedups, {result['gpu']}, {result['date']}")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, help="measure on the GPU and write layers-<date>.json here")
    parser.add_argument("--quick", action="store_true", help="leave out the batch-1 conv rows")
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile columns")
    parser.add_argument(
        "--only", action="append", help="only rows whose 'NAME B=BATCH DTYPE' contains this (repeatable)"
    )
    parser.add_argument("--table", type=Path, help="print the markdown table of a results JSON")
    parser.add_argument("--plot", nargs=2, type=Path, metavar=("RESULTS", "PNG"), help="write the speedup plot")
    args = parser.parse_args(argv)
    if args.table:
        sys.stdout.write(table(json.loads(args.table.read_text())))
    elif args.plot:
        plot(json.loads(args.plot[0].read_text()), args.plot[1])
    elif args.out:
        if not torch.cuda.is_available():
            parser.error("measuring needs a CUDA GPU")
        print(run(args.out, args.quick, args.no_compile, args.only))
    else:
        parser.print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
