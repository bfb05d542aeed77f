"""ONNX in: an ONNX model (file or ModelProto) becomes a torch.fx GraphModule of plain torch calls.

The steps, in order, each failing with an error that names the file and the problem:

1. load the protobuf (FileNotFoundError for a missing file, OnnxModelError for bytes that are not an
   ONNX model, e.g. a truncated file), without external data yet;
2. check external data files exist and are long enough (FileNotFoundError / OnnxModelError), then run
   ``onnx.checker`` (OnnxModelError);
3. find a converter for every node before any work is done (NotImplementedError naming op_type,
   domain, opset and node of each op that has none);
4. infer shapes (on the model without its external weights: only ranks and dtypes are needed), then
   load the external data;
5. build the graph: one placeholder per graph input in order, initializers as buffers of the root read
   through get_attr, each node through its converter, outputs as a tensor or a tuple.

The batch dimension stays dynamic: it is read at run time (``x.size(0)``), never taken from the shapes
seen at import time. Dims the file fixes (``[N, 3, 640, 640]`` fixes every feature map's height and width)
are numbers, so shape arithmetic over them folds at import time; dims it leaves symbolic are read at run
time. Where ONNX's shape inference stops (it does not evaluate float arithmetic on sizes, as TorchScript's
export of a "same" padding writes), the builder works the dims out itself from the graph built so far, by
running each op on meta tensors (GraphBuilder.note_static_shape). The caller's ModelProto is not modified.
"""

from __future__ import annotations

import os
from pathlib import Path

import onnx
import torch
from google.protobuf.message import DecodeError
from onnx import external_data_helper
from torch import fx

# The converter modules register themselves in REGISTRY when imported.
from fuser.onnx import convert_activations, convert_elementwise, convert_layers, convert_shapes  # noqa: F401
from fuser.onnx.builder import GraphBuilder, NodeContext, tensor_from_proto
from fuser.onnx.errors import OnnxConversionError, OnnxModelError
from fuser.onnx.registry import REGISTRY, domain_label, normalize_domain

_MODEL_PROTO = "<ModelProto>"


def import_onnx(model: str | os.PathLike | onnx.ModelProto) -> fx.GraphModule:
    """Convert an ONNX model to a GraphModule computing the same function with plain torch calls.

    ``model`` is a path to a ``.onnx`` file (external data is read from its folder) or a ModelProto
    (whose external data, if any, must already be loaded). The result's ``forward`` takes the graph
    inputs in order (initializers listed as inputs are constants) and returns one tensor or a tuple.
    """
    proto, path = _load(model)
    source = str(path) if path is not None else _MODEL_PROTO
    _check(proto, path, source)
    opsets = _opsets(proto)
    _require_converters(proto.graph, opsets, source)
    inferred = _infer_shapes(proto, source)
    if path is not None:
        external_data_helper.load_external_data_for_model(inferred, str(path.parent))
    return _build(inferred, opsets, source)


def _load(model: str | os.PathLike | onnx.ModelProto) -> tuple[onnx.ModelProto, Path | None]:
    if isinstance(model, onnx.ModelProto):
        for tensor in _tensors(model.graph):
            if external_data_helper.uses_external_data(tensor):
                raise OnnxModelError(
                    f"{_MODEL_PROTO}: initializer {tensor.name!r} is stored as external data that was not "
                    "loaded; pass the .onnx path instead, or onnx.load it with load_external_data=True"
                )
        return model, None
    if not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"expected a path or an onnx.ModelProto, got {type(model).__name__}")
    path = Path(model)
    if not path.exists():
        raise FileNotFoundError(f"ONNX model file not found: {path}")
    if not path.is_file():
        raise OnnxModelError(f"{path}: not a file")
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except DecodeError as e:
        raise OnnxModelError(
            f"{path}: not a valid ONNX model: the protobuf does not parse ({e}); the file is truncated or not ONNX"
        ) from None
    if proto.ir_version == 0 or not proto.HasField("graph"):
        raise OnnxModelError(f"{path}: not an ONNX model (no IR version or no graph in the protobuf)")
    return proto, path


def _tensors(graph: onnx.GraphProto) -> list[onnx.TensorProto]:
    """Initializers and Constant values of the graph (external data can live in either)."""
    tensors = list(graph.initializer)
    for node in graph.node:
        tensors += [a.t for a in node.attribute if a.type == onnx.AttributeProto.TENSOR]
    return tensors


def _check(proto: onnx.ModelProto, path: Path | None, source: str) -> None:
    if path is not None:
        for tensor in _tensors(proto.graph):
            if external_data_helper.uses_external_data(tensor):
                _check_external_data(tensor, path)
    try:
        # By path, the checker resolves external data and handles models over 2 GB.
        onnx.checker.check_model(str(path) if path is not None else proto)
    except (onnx.checker.ValidationError, ValueError) as e:
        raise OnnxModelError(f"{source}: onnx.checker rejects the model: {e}") from None


def _check_external_data(tensor: onnx.TensorProto, path: Path) -> None:
    info = external_data_helper.ExternalDataInfo(tensor)
    data = path.parent / info.location
    if not data.is_file():
        raise FileNotFoundError(
            f"{path}: external data file {info.location!r} of initializer {tensor.name!r} not found (looked for {data})"
        )
    end = (info.offset or 0) + (info.length or 0)
    if end > data.stat().st_size:
        raise OnnxModelError(
            f"{path}: external data file {data} is truncated: initializer {tensor.name!r} needs bytes up "
            f"to {end}, the file has {data.stat().st_size}"
        )


def _opsets(proto: onnx.ModelProto) -> dict[str, int]:
    return {normalize_domain(o.domain): o.version for o in proto.opset_import}


def _require_converters(graph: onnx.GraphProto, opsets: dict[str, int], source: str) -> None:
    """Every op without a converter, named with its domain, opset and nodes, in one error."""
    missing: dict[tuple[str, str, int], list[str]] = {}
    for k, node in enumerate(graph.node):
        domain = normalize_domain(node.domain)
        opset = opsets.get(domain, 0)
        if REGISTRY.find(domain, node.op_type, opset) is None:
            missing.setdefault((domain, node.op_type, opset), []).append(node.name or f"#{k}")
    if not missing:
        return
    parts = []
    for (domain, op_type, opset), names in missing.items():
        shown = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        reason = REGISTRY.missing_reason(domain, op_type, opset)
        parts.append(f"op {op_type!r} of domain {domain_label(domain)!r} at opset {opset} (node {shown}): {reason}")
    raise NotImplementedError(f"{source}: no converter for " + "; ".join(parts))


def _infer_shapes(proto: onnx.ModelProto, source: str) -> onnx.ModelProto:
    try:
        return onnx.shape_inference.infer_shapes(proto, check_type=False, strict_mode=False, data_prop=True)
    except (onnx.shape_inference.InferenceError, ValueError) as e:
        raise OnnxModelError(f"{source}: ONNX shape inference failed: {e}") from None


def _build(proto: onnx.ModelProto, opsets: dict[str, int], source: str) -> fx.GraphModule:
    graph = proto.graph
    types = {v.name: v.type for v in (*graph.input, *graph.value_info, *graph.output)}
    builder = GraphBuilder(types)
    for init in graph.initializer:
        tensor = tensor_from_proto(init)
        builder.values[init.name] = tensor
        builder.name_constant(tensor, init.name)
    for value in graph.input:
        if value.name not in builder.values:
            builder.values[value.name] = builder.placeholder(value.name)
            builder.note_static_shape(builder.values[value.name], value.name)
    used = {name for node in graph.node for name in node.input} | {o.name for o in graph.output}

    for node in graph.node:
        ctx = NodeContext(builder, node, opsets[normalize_domain(node.domain)])
        fn = REGISTRY.lookup(node.domain, node.op_type, ctx.opset, ctx.name)
        builder.current_node, builder.current_output = ctx.name, (node.output[0] if node.output else ctx.name)
        try:
            result = fn(ctx)
        except NotImplementedError as e:
            raise NotImplementedError(f"{source}: {e}") from None
        except OnnxConversionError as e:
            raise OnnxConversionError(f"{source}: {e}") from None
        except Exception as e:
            raise OnnxConversionError(f"{source}: {ctx.describe()}: {type(e).__name__}: {e}") from e
        results = result if isinstance(result, list) else [result]
        for j, name in enumerate(node.output):
            if not name:
                continue
            if j >= len(results):
                if name in used:
                    raise NotImplementedError(f"{source}: {ctx.unsupported(f'using output {j} ({name!r})')}")
                continue
            builder.values[name] = results[j]
            if isinstance(results[j], torch.Tensor):
                builder.name_constant(results[j], name)
            elif isinstance(results[j], fx.Node):
                builder.note_static_shape(results[j], name)

    outputs = [builder.as_node(builder.values[o.name], o.name) for o in graph.output]
    module = builder.finish(outputs, class_name="OnnxGraphModule")
    module.meta["onnx_source"] = source
    return module
