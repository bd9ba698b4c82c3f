"""Scripts that build the ONNX models used by the examples, tests and benchmarks."""
