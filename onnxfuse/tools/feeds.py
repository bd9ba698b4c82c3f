"""The one input maker: seeded random inputs, or values given on the command line.

Floats are N(0, 1), integers in [0, 10) (or 0: indices and ids that must stay in range),
booleans fair coins, drawn in input order from one generator, so the same seed gives the
same inputs in bench, bisect, tune and the benchmarks. An integer or boolean input whose name
holds "mask" (Hugging Face's attention_mask) is a padding mask instead: ones, and in the first
sequence its last quarter of positions 0 (`padding_mask`). A model that does arithmetic with the
mask (transformers 4's (1 - mask) * finfo.min) overflows on other integers: its output and the
float64 reference's were inf and NaN, and the gate compared nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
from onnx import ModelProto, helper

from onnxfuse import files, reference
from onnxfuse.errors import OnnxfuseError
from onnxfuse.tools.shapes import InputSpec


def random_array(rng: np.random.Generator, dtype: np.dtype, shape: tuple[int, ...] | list[int],
                 zero_integers: bool = False) -> np.ndarray:
    """One random input of `dtype` (see the module docstring), C-contiguous."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        a = rng.random(shape) < 0.5
    elif dtype.kind in "iu":
        a = np.zeros(shape, dtype=dtype) if zero_integers else rng.integers(0, 10, size=shape).astype(dtype)
    else:
        a = rng.standard_normal(shape).astype(dtype)
    return np.ascontiguousarray(a)


def padding_mask(dtype: np.dtype, shape: tuple[int, ...] | list[int]) -> np.ndarray:
    """Ones of `dtype`, with the last quarter of the last axis 0 in the first row (a padded
    sequence; no padding where the last axis is under 4 long)."""
    a = np.ones(shape, dtype=dtype)
    if len(shape) >= 2 and shape[-1] >= 4 and a.size:
        a[(0,) * (len(shape) - 1)][shape[-1] - shape[-1] // 4:] = 0
    return a


def make_feeds(specs: Iterable[InputSpec], seed: int = 0, given: Mapping[str, str] | None = None,
               zero_integers: bool = False) -> dict[str, np.ndarray]:
    """Seeded random inputs for `specs`; ``--input NAME=FILE.npy`` or ``NAME=NUMBER`` where
    `given` names them."""
    rng = np.random.default_rng(seed)
    given = given or {}
    feeds: dict[str, np.ndarray] = {}
    for s in specs:
        value = given.get(s.name)
        if value is not None:
            feeds[s.name] = given_input(s, value)
        else:
            feeds[s.name] = random_array(rng, np.dtype(s.dtype), s.shape, zero_integers)
            if "mask" in s.name.lower() and np.dtype(s.dtype).kind in "biu":  # (drawn all the same: the
                feeds[s.name] = padding_mask(np.dtype(s.dtype), s.shape)   # inputs after it stay as they were)
    return feeds


def static_feeds(m: ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random inputs for every graph input of `m`, at its static dims (any element
    type numpy knows, bfloat16 included)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for vi in m.graph.input:
        t = vi.type.tensor_type
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type))
        feeds[vi.name] = random_array(rng, dtype, [d.dim_value for d in t.shape.dim])
    return feeds


def given_input(spec: InputSpec, value: str) -> np.ndarray:
    """The value of ``--input NAME=VALUE``: a .npy file of the input's dtype, or a number
    filling its shape."""
    dtype = np.dtype(spec.dtype)
    if value.endswith(".npy"):
        files.record_read(value)
        try:
            a = np.load(value, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise OnnxfuseError(f"--input {spec.name}: cannot read {value} ({e})") from None
        if a.dtype != dtype:
            raise OnnxfuseError(f"--input {spec.name}: {value} holds {a.dtype}, the input is {dtype}")
        return np.ascontiguousarray(a)
    try:
        number = float(value) if reference.is_float(dtype) else int(value)
    except ValueError:
        raise OnnxfuseError(f"--input {spec.name}={value}: expected a number or a .npy file") from None
    return np.full(spec.shape, number, dtype=dtype)


def input_files(assignments: list[str] | None) -> list[str]:
    """The .npy files of --input NAME=VALUE options (inputs of the command)."""
    return [v for a in assignments or () for v in [a.partition("=")[2]] if v.endswith(".npy")]
