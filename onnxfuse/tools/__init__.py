"""The measuring tools' shared parts, apart from the compiler.

- `shapes`: the one ``--shape`` parser and the one dim binder (a model's input signature,
  concrete input shapes from ``--shape`` / ``--batch``, a model with those dims).
- `feeds`: the one maker of seeded random (or given) inputs.
- `session`: the one timed-session runner (ONNX Runtime sessions with IO binding, timed on a
  synchronized wall clock) and its settings.
- `gate`: comparing outputs against a reference (the accuracy gate) and choosing that reference.
- `cuda`: the one libcuda wrapper (device names, memory in use, compute capabilities).

bench, bisect, profile, tune, calibrate and the benchmarks use these; the compiler may use
`shapes` and `cuda` (leaf modules) and never imports `onnxfuse.bench`.
"""
