"""Helpers for the ONNX tests: build small graphs with onnx.helper, run them in onnxruntime and through
the importer, and compare.

onnxruntime (CPUExecutionProvider) is the reference: it is what runs the user's ONNX file today. Every
graph has a symbolic batch dim "N" and is run at two batch sizes, so a batch size baked in at import
time fails.
"""

from __future__ import annotations

import io
from collections.abc import Sequence

import numpy as np
import onnx
import onnxruntime as ort
import torch
from accuracy import TOLERANCE, rel_error
from onnx import TensorProto, helper, numpy_helper

from fuser.onnx.importer import import_onnx

FLOAT = TensorProto.FLOAT
INT64 = TensorProto.INT64
BATCHES = (2, 5)

ORT_OPTIONS = ort.SessionOptions()
ORT_OPTIONS.intra_op_num_threads = 1
# Graph optimizations would rewrite the reference itself (fusing, constant folding); keep it literal.
ORT_OPTIONS.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL


def info(name: str, shape: Sequence[int | str | None] | None, dtype: int = FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, shape)


def const(name: str, array: object, dtype: type | None = None) -> onnx.TensorProto:
    """An initializer; Python ints become int64, floats float32."""
    arr = np.asarray(array, dtype=dtype)
    if dtype is None and arr.dtype == np.float64:
        arr = arr.astype(np.float32)
    return numpy_helper.from_array(arr, name)


def make_model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[onnx.ValueInfoProto],
    outputs: Sequence[onnx.ValueInfoProto],
    initializers: Sequence[onnx.TensorProto] = (),
    opset: int = 17,
) -> onnx.ModelProto:
    """A checked model at ``opset`` (IR version chosen to match the opset).

    Outputs declared without a shape get the one shape inference finds (the checker requires one);
    nothing else of the inference is kept, so the importer does its own.
    """
    graph = helper.make_graph(list(nodes), "test", list(inputs), list(outputs), list(initializers))
    model = helper.make_model_gen_version(graph, opset_imports=[helper.make_opsetid("", opset)])
    inferred = {o.name: o for o in onnx.shape_inference.infer_shapes(model).graph.output}
    for out in model.graph.output:
        if not out.type.tensor_type.HasField("shape"):
            out.CopyFrom(inferred[out.name])
    onnx.checker.check_model(model)
    return model


def single_op(
    op_type: str,
    input_shapes: Sequence[Sequence[int | str]],
    *,
    opset: int = 17,
    initializers: Sequence[onnx.TensorProto] = (),
    extra_inputs: Sequence[str] = (),
    outputs: int = 1,
    output_shape: Sequence[int | str] | None = None,
    output_dtype: int = FLOAT,
    input_dtype: int = FLOAT,
    **attrs: object,
) -> onnx.ModelProto:
    """A one-node graph: runtime inputs x0, x1, ... of the given shapes, then ``extra_inputs`` by name
    (initializers, or "" for an absent optional input); ``outputs`` outputs y0, y1, ... of
    ``output_shape`` (None: the one shape inference finds)."""
    names = [f"x{i}" for i in range(len(input_shapes))]
    node = helper.make_node(
        op_type, [*names, *extra_inputs], [f"y{j}" for j in range(outputs)], name=f"{op_type}_0", **attrs
    )
    inputs = [info(n, s, input_dtype) for n, s in zip(names, input_shapes, strict=True)]
    declared = [info(f"y{j}", output_shape, output_dtype) for j in range(outputs)]
    return make_model([node], inputs, declared, initializers, opset)


def random_feeds(model: onnx.ModelProto, batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs for every graph input; the symbolic dim "N" becomes ``batch``, any other symbolic dim 7."""
    rng = np.random.default_rng(seed)
    inits = {i.name for i in model.graph.initializer}
    feeds = {}
    for value in model.graph.input:
        if value.name in inits:
            continue
        dims = value.type.tensor_type.shape.dim
        shape = [batch if d.dim_param == "N" else 7 if d.dim_param else d.dim_value for d in dims]
        elem = value.type.tensor_type.elem_type
        if elem in (FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE):
            feeds[value.name] = rng.standard_normal(shape).astype(helper.tensor_dtype_to_np_dtype(elem))
        elif elem == TensorProto.BOOL:
            feeds[value.name] = rng.random(shape) > 0.5
        else:
            dtype = helper.tensor_dtype_to_np_dtype(elem)
            feeds[value.name] = rng.integers(-5, 6, shape).astype(dtype)
    return feeds


def run_ort(model: onnx.ModelProto | str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    source = model if isinstance(model, str) else model.SerializeToString()
    session = ort.InferenceSession(source, ORT_OPTIONS, providers=["CPUExecutionProvider"])
    return session.run(None, feeds)


def run_module(module: torch.nn.Module, feeds: dict[str, np.ndarray]) -> list[torch.Tensor]:
    with torch.no_grad():
        out = module(*(torch.from_numpy(v) for v in feeds.values()))
    return list(out) if isinstance(out, tuple) else [out]


def assert_outputs_match(
    got: Sequence[torch.Tensor], expected: Sequence[np.ndarray], what: str, tol: float = TOLERANCE["ieee"]
) -> None:
    """Same count, shapes and dtypes; floats within ``tol`` relative error, everything else exact."""
    assert len(got) == len(expected), f"{what}: {len(got)} outputs, onnxruntime has {len(expected)}"
    for k, (out, ref) in enumerate(zip(got, expected, strict=True)):
        ref_t = torch.from_numpy(np.asarray(ref))
        shapes = f"{tuple(out.shape)} vs onnxruntime {tuple(ref_t.shape)}"
        assert tuple(out.shape) == tuple(ref_t.shape), f"{what} output {k}: shape {shapes}"
        assert out.dtype == ref_t.dtype, f"{what} output {k}: dtype {out.dtype} vs onnxruntime {ref_t.dtype}"
        if ref_t.dtype.is_floating_point:
            err = rel_error(out, ref_t)
            assert err < tol, f"{what} output {k}: relative error {err:.2e} >= {tol:.0e}"
        else:
            assert torch.equal(out, ref_t), f"{what} output {k}: values differ from onnxruntime"


def check_import(
    model: onnx.ModelProto, what: str = "", batches: Sequence[int] = BATCHES, tol: float = TOLERANCE["ieee"]
) -> torch.fx.GraphModule:
    """Import ``model`` and compare it with onnxruntime at each batch size; returns the GraphModule."""
    module = import_onnx(model)
    for batch in batches:
        feeds = random_feeds(model, batch, seed=batch)
        assert_outputs_match(run_module(module, feeds), run_ort(model, feeds), f"{what} batch {batch}", tol)
    return module


def call_targets(module: torch.fx.GraphModule) -> list[object]:
    """The targets of the call nodes, in graph order."""
    return [n.target for n in module.graph.nodes if n.op in ("call_function", "call_method")]


def assert_survives_pickling(module: torch.fx.GraphModule, feeds: dict[str, np.ndarray]) -> None:
    """torch.save / torch.load re-trace a GraphModule's code symbolically: the graph must allow that
    (``fuser optimize -o out.pt`` saves modules this way) and compute the same afterwards."""
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    for a, b in zip(run_module(module, feeds), run_module(loaded, feeds), strict=True):
        assert torch.equal(a, b), "the reloaded module computes something else"
