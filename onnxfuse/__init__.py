"""onnxfuse: make ONNX models faster on NVIDIA GPUs under ONNX Runtime, without changing their answers."""

__version__ = "0.1.0"
