"""The benchmark scripts on the CPU, so a GPU run does not fail on their own code: one whole-model row
measured in this process, a failing variant recorded while the others go on, the kernel classifier,
the optimize() arguments for either fuser signature, which runs the results generator shows, and what its
zoo and CPU lines say."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

import fuser
from benchmarks import bordered_copy, box_tiles, gpu_models, layers, readme_results, zoo_cpu
from benchmarks.measure import is_conv_or_matmul


def test_rel_error_covers_every_tensor_of_nested_outputs() -> None:
    ref = (torch.randn(3, 5, dtype=torch.float64), {"boxes": torch.randn(7, dtype=torch.float64)})
    out = (ref[0].float(), {"boxes": ref[1]["boxes"].float()})
    assert gpu_models.rel_error(out, ref) < 1e-7
    out[1]["boxes"][2] += 1.0  # an error only in the second output must show
    assert gpu_models.rel_error(out, ref) > 1e-2
    with pytest.raises(ValueError, match="structure"):
        gpu_models.rel_error(out[0], ref)


@pytest.mark.parametrize(
    ("name", "conv"),
    [
        ("sm90_xmma_fprop_implicit_gemm_tf32f32_tf32f32_f32_nhwckrsc_nhwc_tilesize128x64x32", True),
        ("_conv2d_act_kernel", True),
        ("_gemm_act_kernel", True),
        ("_depthwise_act_kernel", True),
        ("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", True),
        ("triton_poi_fused_convolution_silu_0", False),
        ("triton_red_fused_mean_3", False),
        ("void at::native::(anonymous namespace)::CatArrayBatchedCopy<float, unsigned int, 4>", False),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel>", False),
        ("aten::convolution", True),
        ("aten::max_pool2d", False),
    ],
)
def test_kernel_classifier(name: str, conv: bool) -> None:
    assert is_conv_or_matmul(name) is conv


def test_mma_kind_reads_the_kernels_the_launch_point_returns() -> None:
    """The layer benchmark's tensor-core column reads the PTX of what ``LaunchOptions.launch`` returns (it
    read a per-module ``launch`` that a refactor removed, and every row became an error)."""
    from fuser.kernels.launch import LaunchOptions

    class Compiled:
        def __init__(self, ptx: str) -> None:
            self.asm = {"ptx": ptx}

    class Kernel:
        params = ()

        def __init__(self, ptx: str) -> None:
            self.ptx = ptx

        def __getitem__(self, grid):
            return lambda *args, **kwargs: Compiled(self.ptx)

    def call(*ptx: str):
        return lambda: [LaunchOptions({}).launch(Kernel(text), (1,), ()) for text in ptx]

    assert layers.mma_kind(call("ld.global", "wgmma.mma_async.sync.aligned")) == "wgmma"
    assert layers.mma_kind(call("mma.sync.aligned.m16n8k8")) == "mma"
    assert layers.mma_kind(call("fma.rn.f32")) == "none"
    assert LaunchOptions.launch is not None and "recording" not in LaunchOptions.launch.__qualname__


def test_box_benchmark_reads_where_the_dot_takes_its_a_operand() -> None:
    """box_tiles' column of where wgmma reads its A operand comes from the operand types of the TTGIR dot."""

    class Compiled:
        def __init__(self, dot_types: str) -> None:
            attributes = "{inputPrecision = 0 : i32, isAsync = true}"  # its " : i32" is not the operand types
            self.asm = {"ttgir": f"  %acc = ttng.warp_group_dot %a, %w, %c {attributes} : {dot_types} loc(#l)\n"}

    shared = Compiled("!ttg.memdesc<128x64xf16, #shared1, #smem> * !ttg.memdesc<64x128xf16, #shared3, #smem> -> t")
    registers = Compiled("tensor<128x32xf16, #ttg.dot_op<{opIdx = 0}>> * !ttg.memdesc<32x128xf16, #s, #smem> -> t")
    assert box_tiles.a_operand([shared]) == "shared"
    assert box_tiles.a_operand([registers]) == "registers"
    assert box_tiles.a_operand([shared, registers]) == "registers+shared"
    assert box_tiles.a_operand([]) == "no wgmma"
    row = {"layer": "l", "batch": 8, "dtype": "fp16", "cudnn_folded_act_ms": 0.2,
           "configs": {"rows default": {"ms": 0.2, "rel_error": 1e-4, "a_operand": "registers"},
                       "box 0": {"ms": 0.1, "rel_error": 2e-4, "a_operand": "shared"},
                       "box 1": {"error": "OutOfResources: shared memory"}}}  # fmt: skip
    line = box_tiles.short_line(row)
    assert "best box 0 (shared) 0.1000" in line and "x rows 2.00" in line and "FAILED box 1" in line


def test_the_copy_benchmarks_baseline_is_the_bordered_input() -> None:
    """bordered_copy's baseline (the torch ops the kernel replaced) builds the same buffer as F.pad, so the
    benchmark compares two ways of one copy; without a GPU the script says so and exits 2."""
    x = (torch.randn(3, 24, 5, 7) + 2.0).to(memory_format=torch.channels_last)
    expected = torch.nn.functional.pad(x.permute(0, 2, 3, 1), (0, 0, 1, 0, 1, 0))
    assert torch.equal(bordered_copy.torch_ops_copy(x, 1, 1).view(3, 6, 8, 24), expected)
    if not torch.cuda.is_available():
        assert bordered_copy.main([]) == 2


def test_the_layer_plot_draws_every_baseline_the_rows_have(tmp_path: Path) -> None:
    """Each plotted series is a speedup add_ratios writes (conv or linear key); a baseline a row lacks (no
    torch.compile at batch 1) draws no bar rather than failing."""
    conv = {"kind": "conv", "layer": "c", "batch": 1, "dtype": "fp32", "fused_ms": 0.5, "eager_nchw_ms": 1.0,
            "eager_cl_ms": 0.9, "cudnn_folded_act_ms": 0.6, "floor_ms": 0.1}  # fmt: skip
    linear = {"kind": "linear", "layer": "l", "batch": 16, "dtype": "bf16", "fused_ms": 0.2, "eager_ms": 0.3,
              "matmul_alone_ms": 0.25, "torch_compile_ms": 0.4, "floor_ms": 0.1}  # fmt: skip
    for row in (conv, linear):
        layers.add_ratios(row)
    for _, key, linear_key in layers.PLOT_SERIES:
        assert key in conv or key in linear, key
        assert linear_key is None or linear_key in linear, linear_key
    layers.plot({"gpu": "CPU", "date": "2026-12-03", "rows": [conv, linear]}, tmp_path / "layers.png")
    assert (tmp_path / "layers.png").stat().st_size > 0


def test_source_digest_names_the_tree_on_disk(tmp_path: Path) -> None:
    """Runs record which sources they measured by content, not by the git metadata beside them."""
    for folder in gpu_models.SOURCE_FOLDERS:
        (tmp_path / folder / "sub").mkdir(parents=True)
        (tmp_path / folder / "sub" / "a.py").write_text(f"x = '{folder}'\n")
    (tmp_path / "kernels" / "tile_table_sm90.json").write_text("{}\n")
    first = gpu_models.source_digest(tmp_path)
    (tmp_path / "fuser" / "notes.md").write_text("not a source")
    assert gpu_models.source_digest(tmp_path) == first
    (tmp_path / "kernels" / "tile_table_sm90.json").write_text('{"sm90": 1}\n')
    assert gpu_models.source_digest(tmp_path) != first
    assert len(gpu_models.source_digest()) == 12 and gpu_models.versions()["fuser_source"] == gpu_models.source_digest()


def test_the_commit_is_recorded_with_whether_the_sources_are_its(tmp_path: Path) -> None:
    """A run names the git HEAD beside the sources and says whether the files are that commit's (on the device
    machine they are not: its copy keeps an earlier commit's metadata)."""
    import subprocess

    git = lambda *args: subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)
    assert gpu_models.git_commit(tmp_path) == (None, None)
    git("init", "-q")
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "conv.py").write_text("x = 1\n")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True, text=True)
    assert gpu_models.git_commit(tmp_path) == (head.stdout.strip(), True)
    (tmp_path / "README.md").write_text("not a source\n")
    assert gpu_models.git_commit(tmp_path)[1] is True
    (tmp_path / "kernels" / "conv.py").write_text("x = 2\n")
    assert gpu_models.git_commit(tmp_path) == (head.stdout.strip(), False)


def test_optimize_kwargs_follow_the_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "tune" not in gpu_models.optimize_kwargs("tf32", True, "default")

    def with_tune(model, example_inputs=None, *, precision="tf32", backend="auto", cuda_graphs=False, tune=False):
        return model

    monkeypatch.setattr(fuser, "optimize", with_tune)
    kwargs = gpu_models.optimize_kwargs("fp16", False, "on")
    assert kwargs == {"precision": "fp16", "backend": "auto", "cuda_graphs": False, "tune": True}


def test_one_row_measured_and_a_failing_variant_recorded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def planted(self, module):
        raise RuntimeError("planted compile failure")

    monkeypatch.setattr(gpu_models.Row, "compiled", planted)
    settings = {
        "device": "cpu",
        "size": 33,
        "variants": list(gpu_models.VARIANTS),
        "calls": 1,
        "repeats": 2,
        "warmup": 1,
        "tune": "off",
        "compile_backend": "eager",
    }
    row = gpu_models.run_row(settings, "fuser.resnet26", 1, "float32", tmp_path / "row.json")
    assert json.loads((tmp_path / "row.json").read_text()) == json.loads(json.dumps(row))
    measured = {"eager", "eager+cuda_graphs", "fuser", "fuser+cuda_graphs"}
    assert set(row["ms"]) == measured and all(v > 0 for v in row["ms"].values())
    assert set(row["errors"]) == set(gpu_models.COMPILED)
    assert all("planted compile failure" in e for e in row["errors"].values())
    assert all(row["rel_error"][v] < 1e-4 for v in measured)  # float32 against float64, torch backend
    assert row["fused_chains"] > 0 and row["optimize_s_cold"] > 0 and row["optimize_s_warm"] > 0
    assert row["kernels"]["fuser"] < row["kernels"]["eager"]  # BN ops folded away
    result = {"format": gpu_models.FORMAT, "card": "CPU", "date": "2026-12-01", "rows": [row]}
    text = gpu_models.table(result)
    assert "fuser.resnet26 (fuser.models)" in text and "planted compile failure" in text
    gpu_models.plot(result, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_compile_s_is_the_time_of_the_calls_that_compile(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A compiled variant's first calls are where it compiles: compile_s is their time, not that of calls
    made after it compiled (the first version timed the first calls twice and kept the second, fast set)."""

    def slow_first_call(self, module):
        calls = []

        def forward(x):
            if not calls:
                time.sleep(0.3)  # the compile
            calls.append(1)
            return module(x)

        return forward

    import torch._dynamo.utils

    monkeypatch.setattr(gpu_models.Row, "compiled", slow_first_call)
    torch._dynamo.utils.counters.clear()  # the real Row.compiled clears them; earlier tests' compiles must not count
    settings = {
        "device": "cpu",
        "size": 33,
        "variants": ["eager", "torch.compile reduce-overhead"],
        "calls": 1,
        "repeats": 1,
        "warmup": 1,
        "tune": "off",
        "compile_backend": "eager",
    }
    row = gpu_models.run_row(settings, "fuser.resnet26", 1, "float32", tmp_path / "row.json")
    assert row["compile_s"]["torch.compile reduce-overhead"] >= 0.3
    assert row["dynamo"]["torch.compile reduce-overhead"]["frames_compiled"] == 0  # nothing went through dynamo


def test_generator_shows_the_newest_complete_run(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    runs = {
        "gpu-models-2026-11-30.json": {"date": "2026-11-30"},
        "gpu-models-2026-12-01a.json": {"date": "2026-12-01", "superseded": "kept as evidence"},
        "gpu-models-2026-12-01b.json": {"date": "2026-12-01"},
        "gpu-models-2026-12-01-followup.json": {"date": "2026-12-01", "partial": "a follow-up"},
        "gpu-models-2026-12-01c.json": {"date": "2026-12-01", "format": 2, "time": "12:00 UTC"},
        "gpu-models-2026-12-01-quick.json": {"date": "2026-12-01", "format": 2, "partial": "quick check"},
    }
    for name, body in runs.items():
        (tmp_path / name).write_text(json.dumps(body | {"rows": []}))
    monkeypatch.setattr(readme_results, "RESULTS", tmp_path)
    complete, partial, earlier = readme_results.runs("gpu-models-*.json")
    assert [p.name for p in complete] == ["gpu-models-2026-12-01c.json"]  # the newest format only
    assert partial == []
    assert sorted(p.name for p in earlier) == sorted(set(runs) - {"gpu-models-2026-12-01c.json",
                                                                   "gpu-models-2026-12-01-quick.json"})  # fmt: skip


def _model_row(model: str, batch: int, fuser_ms: float) -> dict:
    ms = {"fuser+cuda_graphs": fuser_ms, "eager+cuda_graphs": 3.0, "torch.compile reduce-overhead": 1.5}
    return {"model": model, "source": "torchvision", "batch": batch, "dtype": "float16", "ms": ms}


def test_headline_takes_each_row_from_the_newest_run_that_measured_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Two complete runs of one day on two trees: the older one's time of a row the newer one measured again is
    left out of the headline (it once reported 38 rows of 8 models), a row only the older one has is kept, and
    the headline says which run gave how many."""
    run = {"date": "2026-12-03", "card": "NVIDIA H200"}
    older = run | {
        "time": "10:00 UTC",
        "rows": [_model_row("resnet50", 32, 0.5), _model_row("mobilenet_v3_large", 32, 1.2)],
    }
    newer = run | {"time": "14:00 UTC", "rows": [_model_row("resnet50", 32, 1.0)]}
    (tmp_path / "gpu-models-2026-12-03a.json").write_text(json.dumps(older))
    (tmp_path / "gpu-models-2026-12-03b.json").write_text(json.dumps(newer))
    monkeypatch.setattr(readme_results, "RESULTS", tmp_path)
    monkeypatch.setattr(readme_results, "ROOT", tmp_path)
    line = next(row for row in readme_results.summary().splitlines() if row.startswith("| Whole models on the GPU"))
    assert "1.25-1.50x against torch.compile reduce-overhead (2 model rows)" in line  # 1.5 / 1.0 and 1.5 / 1.2
    assert "2.50-3.00x against eager with CUDA graphs" in line  # with the older 0.5 ms ResNet-50 row: 2.50-6.00x
    assert "1 from `gpu-models-2026-12-03b.json`, 1 from `gpu-models-2026-12-03a.json`" in line


CHECKS = ["bn", "error", "untouched", "save_load", "no_dead_weights"]  # tests/zoo/zoo_checks.py's


def _zoo_row(model: str, before: int, unfolded: dict[str, str | None], failures: dict) -> dict:
    return {
        "model": model, "library": "timm", "task": "classification", "chains_fused": 7, "bn_ops_before": before,
        "bn_ops_after": len(unfolded), "bn_unfolded": unfolded, "rel_error": 3e-7, "elements_before": 9,
        "elements_after": 9, "optimize_s": 0.5, "failures": dict.fromkeys(CHECKS) | failures,
    }  # fmt: skip


def test_zoo_table_names_every_batch_norm_that_stays() -> None:
    reason = "BatchNorm `batch_norm_{}` (a.{}.norm) follows `cat_{}` (a.{}), not a conv or linear"
    unfolded = {f"a.{i}.norm": reason.format(i, i, i, i) for i in (3, 11)}
    rows = [
        _zoo_row("densenet", 13, unfolded, {}),
        _zoo_row("repvgg", 7, {"s.1.identity": None}, {"bn": "1 of 7 BatchNorms neither folded nor reported"}),
        {"model": "broken", "library": "timm", "task": "classification", "error": "RuntimeError: boom"},
    ]
    result = {"rows": rows}
    table = zoo_cpu.table(result)
    assert "2 models: all checks passed on 1; 17 of 20 BatchNorm calls folded (85.0%)" in table
    assert "- densenet: 2 x BatchNorm `batch_norm` follows `cat`, not a conv or linear (`a.*.norm`)" in table
    assert "- repvgg: 1 x not in the report (`s.*.identity`)" in table
    assert "| broken | timm | classification | error: RuntimeError: boom |" in table
    line = readme_results._line("zoo-cpu-*.json", result)
    assert line.startswith("3 models: every check passed on 1, 2 failed; 17 of 20 BatchNorms folded (85.0%)")


def test_cpu_line_gives_no_speed_figure_for_runs_not_interleaved() -> None:
    rows = [{"speedup": 1.12}, {"speedup": 1.03}]
    line = readme_results._line("cpu-models-*.json", {"machine": {"threads": 2}, "rows": rows})
    assert "no speed figure" in line and "1.12" not in line
    interleaved = [{"speedup": 1.2, "speedup_pairwise": 0.98}, {"speedup": 1.0, "speedup_pairwise": 1.04}]
    line = readme_results._line("cpu-models-*.json", {"machine": {"threads": 1}, "rows": interleaved})
    assert "0.98-1.04x" in line


def _sweep(
    ms: dict[str, float | None], layer: str = "resnet50.layer4.3x3@7", dtype: str = "float16", wrong: str = ""
) -> dict:
    """A sweep file's one row: each label's time (None: it did not run), every output within tolerance of
    float64 but ``wrong``'s (a relative error of 0.17, as a miscompiled tile gave)."""
    measured = lambda label, t: {"ms": t, "rel_error": 0.17 if label == wrong else 3e-4}
    configs = {label: measured(label, t) if t is not None else {"error": "OutOfResources"} for label, t in ms.items()}
    return {"date": "2026-12-03", "card": "NVIDIA H200", "rows": [{"layer": layer, "batch": 32, "dtype": dtype,
            "configs": {"rows-128x128x64w8s4": {"ms": 0.001}, **configs}}]}  # fmt: skip


def test_sweeps_enter_the_table_as_measured_and_only_where_they_measured_every_shape(tmp_path: Path) -> None:
    """benchmarks.tile_table --from-sweep: a config's best time over the files ranks it; a config that failed
    everywhere, or whose output was wrong, is left out; labels with a reduction order, or of the masked shifted
    taps, are not read; a class with a shape the sweep did not measure keeps the table's ranking."""
    from benchmarks.tile_table import merge_sweeps

    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps(_sweep({"64x128x64w4s4": 0.034, "64x256x64w8s3k2": 0.030, "128x256x64w8s3sk1": None,
                                        "128x128x64w8s3": 0.020}, wrong="128x128x64w8s3")))  # fmt: skip
    second.write_text(json.dumps(_sweep({"64x256x64w8s3k2": 0.028, "128x256x64w8s3sk1": None, "64x64x64w4s4t": 0.01})))
    resnet, other = "conv2d_act|fp16|b2|m2048|n512|k8192|g1", "conv2d_act|fp16|b2|m262144|n128|k1024|g1"
    held = {"ranked": [{"config": {"block_m": 64, "block_n": 128, "block_k": 64}, "rel": 1.0}]}
    entries = {resnet: {**held, "shapes": [[1568, 512, 4608, 1]]}, other: {**held, "shapes": [[204800, 80, 576, 1]]}}
    table = {"arch": "sm90", "source": {"date": "then"}, "entries": entries}
    merged, done = merge_sweeps(table, [first, second])
    ranked = merged["entries"][resnet]["ranked"]
    assert [(r["config"]["block_n"], r["config"]["split_k"]) for r in ranked] == [(256, 2), (128, 1)]
    assert ranked[1]["rel"] == pytest.approx(0.034 / 0.028, abs=1e-4)
    assert merged["entries"][other] == table["entries"][other] and done == [f"{resnet}: replaced"]
    assert [s["file"] for s in merged["source"]["sweeps"]] == ["a.json", "b.json"]

    stride2 = tmp_path / "c.json"
    stride2.write_text(json.dumps(_sweep({"128x128x64w8s3": 0.107}, "yolov8.64->128s2@160")))
    assert merge_sweeps(table, [stride2])[1] == [f"{other}: kept (the table also measured [[204800, 80, 576, 1]])"]


def test_stem_sweeps_enter_the_table_as_the_direct_kernels_choices(tmp_path: Path) -> None:
    """An RGB stem's row ranks the direct kernel's class, in configs its candidate list holds (group_m 1), so that
    the table's lookup returns the measured best for the stem at batch 32 in tf32."""
    from benchmarks.tile_table import merge_sweeps
    from fuser.kernels import tile_table
    from fuser.kernels.autotune import Problem
    from fuser.kernels.direct_conv import direct_candidates

    sweep = _sweep({"256x16x1w4s1": 0.195, "128x16x1w2s1": 0.171, "512x16x1w4s1": None}, "yolov8.stem", "float32")
    (tmp_path / "rgb.json").write_text(json.dumps(sweep))
    table = {"arch": "sm90", "source": {"date": "then"}, "entries": {}}
    merged, done = merge_sweeps(table, [tmp_path / "rgb.json"])
    stem = "direct_conv_act|tf32|b4|m4194304|n16|k32|g1"
    assert done == [f"{stem}: added"]
    ranked = merged["entries"][stem]["ranked"]
    assert [(r["config"]["block_m"], r["config"]["num_warps"]) for r in ranked] == [(128, 2), (256, 4)]
    assert merged["entries"][stem]["shapes"] == [[32 * 320 * 320, 16, 27, 1]]
    tile_table._loaded[tile_table.table_path("sm90")] = merged["entries"]
    try:
        problem = Problem(32 * 320 * 320, 16, 27, 1, 4, "tf32")
        chosen = tile_table.lookup("sm90", "direct_conv_act", problem, direct_candidates(16))
    finally:
        tile_table._loaded.clear()
    assert chosen is not None and (chosen.block_m, chosen.num_warps, chosen.group_m) == (128, 2, 1)


def test_persistent_twins_enter_the_table_with_their_programs_per_sm(tmp_path: Path) -> None:
    """A label ending in 'p' and a count is the tile on a persistent grid of that many programs per SM."""
    from benchmarks.tile_table import merge_sweeps
    from fuser.kernels.autotune import TileConfig
    from fuser.kernels.conv import persistent_variants

    box = TileConfig(128, 64, 64, 8, 8, 3, box_w=16)
    twins = persistent_variants([box, TileConfig(64, 64, 64, 8, 4, 4, split_k=2)], (2, 3))
    assert [(t.box_w, t.persistent) for t in twins] == [(16, 2), (16, 3)]
    sweep = _sweep({"128x64x64w8s3b16": 0.068, "128x64x64w8s3b16p2": 0.061, "128x64x64w8s3b16p3": 0.064},
                   "yolov8.64x3x3@80")  # fmt: skip
    (tmp_path / "p.json").write_text(json.dumps(sweep))
    table = {"arch": "sm90", "source": {"date": "then"}, "entries": {}}
    entries = merge_sweeps(table, [tmp_path / "p.json"])[0]["entries"]
    (ranked,) = [e["ranked"] for e in entries.values()]
    assert [(r["config"]["box_w"], r["config"]["persistent"]) for r in ranked] == [(16, 2), (16, 3), (16, 0)]


# (sweep file, input shape, stride, output channels, precision, the table's choice as (block_m, block_n, block_k,
# warps, stages, box_w, persistent)): YOLOv8n's layers at batch 32 whose classes those sweeps rebuilt
SWEPT_CHOICES = [
    ("conv-tile-sweep-2026-12-04-persistent.json", (32, 64, 80, 80), 1, 64, "fp16", (128, 64, 64, 4, 4, 16, 2)),
    ("conv-tile-sweep-2026-12-04-persistent.json", (32, 64, 80, 80), 1, 64, "tf32", (128, 64, 32, 4, 4, 16, 2)),
    ("conv-tile-sweep-2026-12-04b.json", (32, 64, 160, 160), 2, 128, "tf32", (128, 128, 32, 4, 4, 16, 0)),
    ("conv-tile-sweep-2026-12-04c.json", (32, 64, 160, 160), 2, 128, "fp16", (64, 128, 64, 4, 3, 16, 3)),
    # the detect head's 80->80 @80 in flat K (row tiles), batch 32 and 1; in tf32 with 32-wide K steps
    ("conv-tile-sweep-2026-12-04g.json", (32, 80, 80, 80), 1, 80, "fp16", (128, 128, 64, 8, 3, 0, 0)),
    ("conv-tile-sweep-2026-12-04i.json", (32, 80, 80, 80), 1, 80, "tf32", (128, 128, 32, 8, 3, 0, 0)),
    ("conv-tile-sweep-2026-12-04g.json", (1, 80, 80, 80), 1, 80, "fp16", (64, 128, 64, 4, 4, 0, 0)),
    ("conv-tile-sweep-2026-12-04i.json", (1, 80, 80, 80), 1, 80, "tf32", (64, 128, 32, 4, 4, 0, 0)),
    # and at the head's other scales, whose classes whole-model tuning had measured in channel blocks
    ("conv-tile-sweep-2026-12-04j.json", (32, 80, 40, 40), 1, 80, "tf32", (128, 128, 32, 8, 3, 0, 0)),
    ("conv-tile-sweep-2026-12-04j.json", (1, 80, 40, 40), 1, 80, "fp16", (32, 64, 64, 4, 3, 0, 0)),
]


@pytest.mark.parametrize(("sweep", "shape", "stride", "c_out", "precision", "chosen"), SWEPT_CHOICES,
                         ids=[f"{c[0][16:-5]}-b{c[1][0]}-{c[3]}-s{c[2]}-{c[4]}" for c in SWEPT_CHOICES])  # fmt: skip
def test_a_committed_sweep_makes_its_best_tile_the_tables_choice(
    sweep: str, shape: tuple[int, int, int, int], stride: int, c_out: int, precision: str, chosen: tuple
) -> None:
    """The committed sweep's fastest tile is one the candidate list offers (a persistent twin on 64->64 @80, a
    strided box, persistent in fp16, on 64->128 stride 2, a flat-K row tile on the detect head's 80->80), so the
    table rebuilt from that sweep makes it the launcher's choice (-04c.json also measured the detect head's convs of
    the same class, its 80->80 in the channel blocks it no longer runs: left out)."""
    from benchmarks.tile_table import merge_sweeps
    from fuser.kernels import pack_conv_weight, tile_table
    from fuser.kernels.autotune import Problem
    from fuser.kernels.conv import conv2d_tile_candidates

    table = {"arch": "sm90", "source": {"date": "then"}, "entries": {}}
    merged = merge_sweeps(table, [Path(readme_results.RESULTS) / sweep])[0]
    dtype = torch.float16 if precision == "fp16" else torch.float32
    packed = pack_conv_weight(torch.randn(c_out, shape[1], 3, 3).to(dtype), precision)
    listed = conv2d_tile_candidates(shape, packed, stride, (1, 1, 1, 1))
    out_hw = shape[2] // stride
    problem = Problem(shape[0] * out_hw * out_hw, c_out, 9 * shape[1], 1, packed.data.element_size(), precision)
    tile_table._loaded[tile_table.table_path("sm90")] = merged["entries"]
    try:
        got = tile_table.lookup("sm90", "conv2d_act", problem, listed)
    finally:
        tile_table._loaded.clear()
    assert got is not None, f"{sweep}: no class for {problem}"
    fields = (got.block_m, got.block_n, got.block_k, got.num_warps, got.num_stages, got.box_w, got.persistent)
    assert fields == chosen, (precision, got)


def test_shifted_taps_enter_the_table_only_from_sweeps_of_the_bordered_input(tmp_path: Path) -> None:
    """A 't' label is a shifted tile over the zero-bordered input where the row records ``bordered_copy_ms``
    (conv_tile_sweep since 2026-12-03d), and the masked kind, which is left out, where it does not."""
    from benchmarks.tile_table import merge_sweeps

    resnet = "conv2d_act|fp16|b2|m2048|n512|k8192|g1"
    table = {"arch": "sm90", "source": {"date": "then"}, "entries": {}}
    bordered = _sweep({"64x128x64w4s4": 0.034, "64x128x64w4s4t": 0.027})
    masked = _sweep({"64x128x64w4s4": 0.034, "64x128x64w4s4t": 0.01})
    bordered["rows"][0]["bordered_copy_ms"] = 0.005
    (tmp_path / "bordered.json").write_text(json.dumps(bordered))
    (tmp_path / "masked.json").write_text(json.dumps(masked))
    ranked = merge_sweeps(table, [tmp_path / "bordered.json"])[0]["entries"][resnet]["ranked"]
    assert [(r["config"]["block_m"], r["config"]["tap_shift"]) for r in ranked] == [(64, 1), (64, 0)]
    assert ranked[1]["rel"] == pytest.approx(0.034 / 0.027, abs=1e-4)
    ranked = merge_sweeps(table, [tmp_path / "masked.json"])[0]["entries"][resnet]["ranked"]
    assert [r["config"]["tap_shift"] for r in ranked] == [0]


def test_sweep_rows_enter_the_table_only_in_the_reduction_order_the_layer_runs_now() -> None:
    """The detect head's 80->80 conv ran in channel blocks in sweeps before its routing to flat K, which did not
    record an order: those rows name other kernels' tiles and are left out; a row recording the flat order is read;
    a row recording channel blocks is left out too."""
    from benchmarks.conv_tile_sweep import cache_entries

    head = "yolov8.head.80x3x3@80"
    before = _sweep({"128x128x64w8s3": 0.18}, layer=head)
    flat = _sweep({"128x128x64w8s3": 0.13}, layer=head)
    flat["rows"][0]["order"] = "implicit-gemm conv (flat K)"
    blocks = _sweep({"128x128x64w8s3": 0.18}, layer=head)
    blocks["rows"][0]["order"] = "implicit-gemm conv"
    assert cache_entries(before) == [] and cache_entries(blocks) == []
    (entry,) = cache_entries(flat)
    assert entry["problem"]["k"] == 720 and [t for _, t in entry["timings_ms"]] == [0.13]
    assert len(cache_entries(_sweep({"128x128x64w8s3": 0.05}, layer="yolov8.64x3x3@80"))) == 1  # no order: blocks


def test_the_shipped_table_picks_what_the_late_layer_sweep_measured_fastest() -> None:
    """The classes the sweep added (results/conv-tile-sweep-2026-12-03*.json): the default is the best-ranked of
    the launch's candidates, and within 7% of the class's measured best (the sweep also forced tiles that no list
    offers: 512->512 @7 tf32 ran fastest on a split 64x128 shifted tile, 6% ahead of the listed unsplit one), else
    the lookup would silently fall to a much worse one."""
    from fuser.kernels import autotune, pack_conv_weight, tile_table
    from fuser.kernels.conv import conv2d_tile_candidates
    from fuser.kernels.tile_config import Problem

    for c, hw, dtype, prec in [(512, 7, torch.float16, "fp16"), (512, 7, torch.float32, "tf32"),
                               (256, 20, torch.float32, "tf32")]:  # fmt: skip
        packed = pack_conv_weight(torch.randn(c, c, 3, 3, dtype=dtype), prec)
        candidates = conv2d_tile_candidates((32, c, hw, hw), packed, 1, (1, 1, 1, 1))
        problem = Problem(32 * hw * hw, c, 9 * c, 1, packed.data.element_size(), prec)
        entry = tile_table.load("sm90")[tile_table.shape_class("conv2d_act", problem)]
        listed = [r for r in entry["ranked"] if tile_table.config_from_dict(r["config"]) in candidates]
        assert listed and listed[0]["rel"] <= 1.07, f"{c} @{hw} {prec}: {entry['ranked'][:3]}"
        best = tile_table.config_from_dict(listed[0]["config"])
        assert autotune.default_config("conv2d_act", candidates, problem, "sm90") == best


@pytest.mark.parametrize("layer", ["yolo 3->16 3x3 s2 @640", "yolo 64->64 3x3 s1 @80"])
def test_the_profiled_launches_compute_the_layer(layer: str) -> None:
    """benchmarks.stall_profile launches what device_profile.sh hands Nsight Compute: the fused conv -> BN -> SiLU
    of a layers.py row (the direct kernel, the implicit GEMM), here in the interpreter at size 17, matching the
    float64 block it was folded from."""
    import torch.nn.functional as F

    from benchmarks import stall_profile
    from fuser.verification import TOLERANCE

    row = stall_profile.LAYERS[layer]
    small = layers.ConvLayer(row.name, row.c_in, row.c_out, row.kernel, row.stride, 17, row.groups)
    run = stall_profile.launches(small, "fp32", batch=2, calls=2, interpret=True)
    ref = F.silu(F.conv2d(run.x.double(), run.weight64, run.bias64, row.stride, row.padding, 1, row.groups))
    assert run.out.shape == ref.shape and gpu_models.rel_error(run.out, ref) < TOLERANCE["tf32"]


@pytest.mark.parametrize("act", ["NONE", "RELU"])
def test_the_epilogue_cost_layers_apply_their_activation(act: str) -> None:
    """benchmarks.epilogue_cost times stall_profile.fused_layer with each activation: the launch must apply the one
    it is given (a layer that ignored it would time the same kernel three times and report no cost). A 17x17 stem
    in the interpreter against the float64 block."""
    import torch.nn.functional as F

    from benchmarks import stall_profile
    from fuser.verification import TOLERANCE

    row = stall_profile.LAYERS["yolo 3->16 3x3 s2 @640"]
    small = layers.ConvLayer(row.name, row.c_in, row.c_out, row.kernel, row.stride, 17, row.groups)
    call, x, w64, b64 = stall_profile.fused_layer(small, "fp32", batch=3, interpret=True, act=act)
    conv = F.conv2d(x.double(), w64, b64, row.stride, row.padding, 1, row.groups)
    ref = conv.relu() if act == "RELU" else conv
    assert (conv < 0).any(), "the check needs negative outputs, where ReLU differs"
    assert gpu_models.rel_error(call(), ref) < TOLERANCE["tf32"]


def test_the_epilogue_cost_table_reads_its_rows() -> None:
    """The table printed last shows each activation's time in microseconds and the SiLU / none ratio; a failed row
    shows its error."""
    from benchmarks import epilogue_cost

    ms = {"NONE": 0.2, "RELU": 0.21, "SILU": 0.25}
    rows = [{"layer": "yolo 3->16 3x3 s2 @640", "dtype": "fp16", "ms": ms, "silu_over_none": 1.25},
            {"layer": "resnet 512->512 3x3 @7", "dtype": "fp32", "error": "RuntimeError: boom"}]  # fmt: skip
    lines = epilogue_cost.table(rows).splitlines()
    assert lines[1].split()[-4:] == ["200.0", "210.0", "250.0", "1.250"]
    assert "RuntimeError: boom" in lines[2]


def test_stall_reasons_reads_a_raw_report(tmp_path: Path) -> None:
    """benchmarks.stall_reasons picks the per-reason stall metrics out of ncu's raw CSV (a header row, a units row,
    one row per kernel, numbers with thousands separators), largest first, and names a report that is not raw."""
    from benchmarks import stall_reasons

    metric = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    header = ["ID", "Kernel Name", "gpu__time_duration.sum", metric.format("long_scoreboard"),
              metric.format("barrier"), metric.format("math_pipe_throttle")]  # fmt: skip
    units = ["", "", "ns", "ratio", "ratio", "ratio"]
    data = ["0", "_conv2d_act_kernel", "68,064", "3.25", "0.5", "1,204.5"]
    text = "==PROF== Connected\n" + "\n".join(",".join(f'"{v}"' for v in r) for r in (header, units, data))
    (tmp_path / "raw.csv").write_text(text)
    found = stall_reasons.stall_reasons(tmp_path / "raw.csv")
    k = "_conv2d_act_kernel"
    assert found == [(k, "math_pipe_throttle", 1204.5), (k, "long_scoreboard", 3.25), (k, "barrier", 0.5)]
    (tmp_path / "details.csv").write_text('"0","2155","python3.12"\n')
    with pytest.raises(ValueError, match="raw-page CSV header"):
        stall_reasons.stall_reasons(tmp_path / "details.csv")


def test_the_sweep_runs_the_detect_heads_80_channels_in_the_blocks_flat_k_left_and_puts_the_routing_back() -> None:
    """The head's 80->80 conv, routed to flat K (row tiles: boxes need channel blocks), also runs in channel blocks
    ('blocks', boxes among its tiles); its 64->80 conv and the other late layers keep the shipped order only; the
    stems keep their two orders; a routing constant the sweep does not know is named."""
    from benchmarks.conv_tile_sweep import reduction_orders, rerouted, routed, shipped_routing
    from fuser.kernels import conv_choice, pack_conv_weight
    from fuser.kernels.conv import conv2d_tile_candidates

    shipped = shipped_routing()
    head = reduction_orders("yolov8.head.80x3x3@80", 80)
    assert set(head) == {"", "blocks"} and head[""] == shipped
    assert set(reduction_orders("yolov8.head.64->80@80", 64)) == {""}
    assert set(reduction_orders("yolov8.64x3x3@80", 64)) == {""}
    assert set(reduction_orders("a 1x1 on 80 channels", 80, k=1)) == {""}  # one tap: channel blocks pad alike
    assert set(reduction_orders("resnet50.conv1", 3)) == {"rows", "flat"}
    packed = pack_conv_weight(torch.randn(80, 80, 3, 3).half(), "fp16")
    assert conv_choice.reduction_order(80, 3, 3) == conv_choice.ConvKernel.IMPLICIT_GEMM_FLAT_K
    listed = conv2d_tile_candidates((31, 80, 79, 81), packed, 1, (1, 1, 1, 1))
    assert listed and not any(c.box_w for c in listed)
    with routed(head["blocks"]):
        assert conv_choice.reduction_order(80, 3, 3) == conv_choice.ConvKernel.IMPLICIT_GEMM
        assert any(c.box_w for c in conv2d_tile_candidates((31, 80, 79, 81), packed, 1, (1, 1, 1, 1)))
    assert shipped_routing() == shipped
    with pytest.raises(ValueError, match="FLAT_K_PADDING"):
        rerouted(FLAT_K_PADDING=0.5)


def test_the_flat_k_lists_hold_no_tile_that_ran_out_of_shared_memory() -> None:
    """The head's 80->80 in flat K at float32: the tiles the GPU refused for shared memory
    (conv-tile-sweep-2026-12-04f.json, where it ran as 'flat-') are not candidates any more, and every whole tile
    the lists give now (32-wide K steps) ran in conv-tile-sweep-2026-12-04i.json."""
    from benchmarks.conv_tile_sweep import LABEL
    from fuser.kernels import pack_conv_weight
    from fuser.kernels.conv import conv2d_tile_candidates

    packed = pack_conv_weight(torch.randn(80, 80, 3, 3), "tf32")

    def whole_labels(batch: int) -> set[str]:
        listed = conv2d_tile_candidates((batch, 80, 80, 80), packed, 1, (1, 1, 1, 1))
        return {f"{c.block_m}x{c.block_n}x{c.block_k}w{c.num_warps}s{c.num_stages}" for c in listed if c.split_k == 1}

    refused = json.loads((Path(readme_results.RESULTS) / "conv-tile-sweep-2026-12-04f.json").read_text())
    checked = 0
    for row in refused["rows"]:
        if row["dtype"] != "float32":
            continue
        for label, measured in row["configs"].items():
            match = LABEL.fullmatch(label.removeprefix("flat-"))
            if not label.startswith("flat-") or match is None or match[6] or match[10]:
                continue  # other orders, split and persistent variants
            if "OutOfResources" in measured.get("error", ""):
                whole = label.removeprefix("flat-")
                assert whole not in whole_labels(row["batch"]), f"b{row['batch']}: {whole} ran out of shared memory"
                checked += 1
    assert checked >= 3
    ran = json.loads((Path(readme_results.RESULTS) / "conv-tile-sweep-2026-12-04i.json").read_text())
    for row in ran["rows"]:
        timed = {label for label, measured in row["configs"].items() if "ms" in measured}
        missing = whole_labels(row["batch"]) - timed
        assert not missing, f"b{row['batch']}: listed, never run: {missing}"


def test_check_then_time_records_errors_and_times_only_what_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer scripts' shared loop (halo_conv, resident_weights): a variant's error against float64, a variant
    that raises kept as a row with its error and not timed, the others timed."""
    timed = []
    monkeypatch.setattr(layers, "bench_ms", lambda fn: timed.append(fn) or 0.25)
    ref = torch.randn(3, 7, dtype=torch.float64)
    calls = {"exact": lambda: ref.float(), "off": lambda: ref.float() * 1.01, "refused": lambda: 1 / 0}
    rows = layers.check_then_time(calls, ref, {"layer": "l", "dtype": "fp16"})
    by = {r["variant"]: r for r in rows}
    assert by["exact"]["rel_error"] < 1e-7 and 9e-3 < by["off"]["rel_error"] < 1.1e-2
    assert by["refused"]["error"].startswith("ZeroDivisionError") and "ms" not in by["refused"]
    assert by["exact"]["ms"] == by["off"]["ms"] == 0.25 and by["exact"]["layer"] == "l"
    assert len(timed) == 6  # two variants, three interleaved rounds
