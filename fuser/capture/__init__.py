"""Capture: the model as torch.fx graphs (tracing), the first step of the pipeline.

ONNX models enter through fuser.onnx.importer instead, which builds the fx graph directly.
"""
