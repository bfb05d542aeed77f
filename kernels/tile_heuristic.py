"""A cost model that picks a tile config among a kernel's candidates without running anything.

It is the default where the shipped table of measured choices (tile_table.py) has no entry for a
problem's shape class, and it only ranks: the config it returns is always one of the candidates it
was given (the first of the cheapest, so a tie keeps the kernel's own preference order).

The model is a wave count over the SMs with a per-round time, built from what the H200 runs showed
(kernels/NOTES.md): small grids leave SMs idle, so tiles that give more CTAs win on small problems
(128x768x3072 in TF32 was fastest with 64x64 tiles, 96 CTAs on 132 SMs); a short reduction gives the
software pipeline no steady state, so several resident CTAs must hide the load latency; a tile wider
than the problem only wastes work (cdiv padding is counted as work); split-K multiplies the CTAs and
divides the reduction, at the price of writing and reducing the partial sums. Two families:

- ``matmul`` (implicit-GEMM conv, GEMM): per k-step a CTA waits for the slowest of its tensor-core
  work, its operand bytes through the SM's L2 port, and one load latency divided over the stages in
  flight. Several CTAs resident on an SM share its tensor cores and port, not the latency, and hide the
  implicit GEMM's per-step overhead under each other's dots.
- ``stencil`` (depthwise and direct convs on the CUDA cores): per filter tap a round waits for its
  FMAs or for one load latency, whichever is longer.

The constants are the measured ceilings of benchmarks/results/layers-2026-12-01.json (matmul TFLOP/s
per precision, copy bandwidth) divided over 132 SMs, and published Hopper limits (shared memory,
registers, warps per SM); the implicit GEMM's k-step costs 1.9x a GEMM's (the batch-32 conv rows of that
file against this model); the latencies are round figures. Absolute times are rough; the ranking is
what is used, and ``benchmarks/tile_table.py`` reports how far the model's pick is from the measured
best on every shape it measures.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from .tile_config import Problem, TileConfig

SM_COUNT = 132
SMEM_BYTES = 227 * 1024
REGISTERS = 65536
MAX_WARPS = 64
MAX_REGS_PER_THREAD = 255

# Tensor-core (CUDA-core for "ieee") flop/us per SM: the ceilings measured on the H200 / 132.
PEAK_FLOP_PER_US = {
    "tf32": 407e6 / SM_COUNT,
    "tf32x3": 407e6 / SM_COUNT / 3,
    "ieee": 60e6 / SM_COUNT,
    "fp16": 749e6 / SM_COUNT,
    "bf16": 782e6 / SM_COUNT,
}
SM_PORT_BYTES_PER_US = 1.0e5  # one SM's share of L2 -> SM bandwidth
L2_BYTES_PER_US = 9.0e6  # all SMs together
HBM_BYTES_PER_US = 4.26e6  # the measured copy bandwidth
LOAD_LATENCY_US = 0.6
SPLIT_REDUCE_US = 3.0  # the second launch of a split reduction kernel
SPLIT_TAIL_US = 1.0  # a split tile's arrival count (an L2 round trip) before its last program reduces
MMA_V2_FACTOR = 0.5  # below 64 rows per tile Triton cannot use wgmma on Hopper
# The implicit GEMM's k-steps (gathered activations, index math) against a plain GEMM's: the batch-32 conv
# rows of layers-2026-12-01.json ran 1.65-2.17x (geomean 1.9x) the time this model gives a GEMM of their size.
IMPLICIT_GEMM_STEP_FACTOR = 1.9
STENCIL_LANE_OPS_PER_US = 1.25e5  # FMA + gathered load per tap element, per SM
STENCIL_TAP_LATENCY_US = 0.3

DEFAULT_MARGIN = 0.10

MATMUL_KERNELS = frozenset({"conv2d_act", "gemm_act"})
STENCIL_KERNELS = frozenset({"depthwise_act", "direct_conv_act"})


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _busiest_sm_us(ctas_per_sm: int, occupancy: int, round_us: Callable[[int], float]) -> float:
    """The busiest SM's time: its CTAs run in rounds of ``occupancy`` (the last one partial), a round
    of ``r`` CTAs taking ``round_us(r)``."""
    full, rest = divmod(ctas_per_sm, occupancy)
    return full * round_us(occupancy) + (round_us(rest) if rest else 0.0)


def pipeline_fits(c: TileConfig, operand_bytes: int) -> bool:
    """Whether every pipeline stage of ``c``'s operand tiles fits in one SM's shared memory: the bound where Triton
    pipelines both operands and allocates each stage (the flat-K loop). :func:`_matmul_us` allows a stage more,
    for the loads Triton cannot pipeline."""
    return c.num_stages * c.stage_bytes(operand_bytes) <= SMEM_BYTES


def _matmul_us(problem: Problem, c: TileConfig, sm_count: int, step_factor: float) -> float:
    elem = problem.operand_bytes
    stage_bytes = c.stage_bytes(elem)
    smem = c.num_stages * stage_bytes
    # The GPU tests ran 128x128x64 fp32 at 4 stages (262 KiB by this count): Triton keeps fewer buffers
    # than stages where it cannot pipeline a load, so only a config over the limit with one buffer
    # fewer counts as unable to run.
    if max(1, c.num_stages - 1) * stage_bytes > SMEM_BYTES:
        return math.inf
    threads = 32 * c.num_warps
    acc_regs = c.block_m * c.block_n // threads
    regs = min(MAX_REGS_PER_THREAD, acc_regs + 40)
    spill = 3.0 if acc_regs + 40 > MAX_REGS_PER_THREAD else 1.0
    occupancy = max(1, min(SMEM_BYTES // smem, REGISTERS // (regs * threads), MAX_WARPS // c.num_warps))

    split = max(1, c.split_k)
    k_slice = _cdiv(max(1, problem.k), split)
    k_steps = _cdiv(k_slice, c.block_k)
    tiles = _cdiv(problem.m, c.block_m) * _cdiv(problem.n, c.block_n) * problem.groups * split
    if tiles == 0:
        return 0.0
    active = min(tiles, sm_count)
    port = min(SM_PORT_BYTES_PER_US, L2_BYTES_PER_US / active)
    peak = PEAK_FLOP_PER_US.get(problem.precision, PEAK_FLOP_PER_US["tf32"])
    if c.block_m < 64:
        peak *= MMA_V2_FACTOR
    step_flops = 2 * c.block_m * c.block_n * c.block_k
    latency = LOAD_LATENCY_US / max(1, c.num_stages - 1)
    epilogue_bytes = c.block_m * c.block_n * 4

    def round_us(r: int) -> float:
        # r resident CTAs each pay 1/r of the implicit GEMM's per-step overhead (its gather's address math and
        # issue), hidden under the others' dots: 128x128 tiles at 2 CTAs per SM ran 1.3x faster per tile than
        # at 1 on YOLO's 64->128 stride-2 layer (results/conv-tile-sweep-2026-12-03.json).
        step = max(r * step_flops / peak, r * stage_bytes / port, latency) * (1 + (step_factor - 1) / r)
        return k_steps * step * spill + 2 * LOAD_LATENCY_US + r * epilogue_bytes / port

    total = _busiest_sm_us(_cdiv(tiles, sm_count), occupancy, round_us)
    if split > 1:
        from .splitk import reduces_in_tail  # splitk's launcher imports this module through autotune

        # Every program stores its partial tile; then each tile's last program reads all of them back through
        # one SM's port, or a second kernel spread over the card does (splitk.py).
        partial_bytes = split * problem.m * problem.n * problem.groups * 4
        if reduces_in_tail(c):
            total += partial_bytes / HBM_BYTES_PER_US + split * epilogue_bytes / port + SPLIT_TAIL_US
        else:
            total += 2 * partial_bytes / HBM_BYTES_PER_US + SPLIT_REDUCE_US
    return total


def _stencil_us(problem: Problem, c: TileConfig, sm_count: int) -> float:
    threads = 32 * c.num_warps
    elements = c.block_m * c.block_n
    regs = min(MAX_REGS_PER_THREAD, 2 * elements // threads + 32)
    spill = 3.0 if 2 * elements // threads + 32 > MAX_REGS_PER_THREAD else 1.0
    occupancy = max(1, min(REGISTERS // (regs * threads), MAX_WARPS // c.num_warps))
    tiles = _cdiv(problem.m, c.block_m) * _cdiv(problem.n, c.block_n) * problem.groups
    if tiles == 0:
        return 0.0
    port = min(SM_PORT_BYTES_PER_US, L2_BYTES_PER_US / min(tiles, sm_count))
    taps = max(1, problem.k)

    def round_us(r: int) -> float:
        tap = max(r * elements / STENCIL_LANE_OPS_PER_US, STENCIL_TAP_LATENCY_US)
        return taps * tap * spill + LOAD_LATENCY_US + r * elements * problem.operand_bytes / port

    return _busiest_sm_us(_cdiv(tiles, sm_count), occupancy, round_us)


def estimate_us(kernel: str, problem: Problem, config: TileConfig, sm_count: int = SM_COUNT) -> float:
    """The model's time for ``config`` on ``problem`` in microseconds (inf: cannot run; nan: the
    kernel has no model)."""
    if kernel in MATMUL_KERNELS:
        return _matmul_us(problem, config, sm_count, IMPLICIT_GEMM_STEP_FACTOR if kernel == "conv2d_act" else 1.0)
    if kernel in STENCIL_KERNELS:
        return _stencil_us(problem, config, sm_count)
    return math.nan


def pick(
    kernel: str,
    candidates: Sequence[TileConfig],
    problem: Problem,
    sm_count: int = SM_COUNT,
    margin: float = DEFAULT_MARGIN,
) -> TileConfig:
    """The kernel's own default (its list's first entry, ordered by the kernel from measurements) unless
    the model expects another candidate to be more than ``margin`` faster; then the first of the
    cheapest. The first candidate where the kernel has no model or none can run.

    The margin is the model's precision: it is rough (see the module docstring), so a close call stays
    the list's, and only a clear win (a grid that leaves most SMs idle, a tile far wider than N)
    overrides it."""
    if not candidates:
        raise ValueError(f"{kernel}: no tile candidates to choose from for {problem}")
    times = [estimate_us(kernel, problem, config, sm_count) for config in candidates]
    finite = [(t, i) for i, t in enumerate(times) if math.isfinite(t)]  # nan and inf never win
    if not finite:
        return candidates[0]
    best_us, best = min(finite)
    if math.isfinite(times[0]) and times[0] <= best_us * (1 + margin):
        return candidates[0]
    return candidates[best]
