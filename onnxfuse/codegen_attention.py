"""Code generation for FusedAttention (docs/format.md): scaled dot-product attention with its
score program (scale, mask), as Triton source text.

A FusedAttention node computes Y = softmax(program(Q @ K^T, extras...)) @ V over the last
axis, the operands read through strides (the Transposes that made the heads are absorbed).
The kernel is the Triton tutorial's fused attention (flash attention's forward pass): program
(i, j) holds BLOCK_M query rows of batch-head j, loops over the keys in blocks of BLOCK_N,
computes the score tile with one `tl.dot`, runs the score program on it, and keeps a running
max and sum (the online softmax) with the fp32 accumulator of P @ V.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from onnxfuse.expr import Program

INT_TYPE = "i32"
MAX_ELEMENTS = 2**31 - 1
SMS = 132  # multiprocessors of the H100 / H200


@dataclass(frozen=True)
class AttentionSpec:
    """What a FusedAttention kernel computes (docs/format.md, FusedAttention)."""

    kind: ClassVar[str] = "attention"  # the Kind whose kernel it is (onnxfuse.kinds.attention)
    name: str
    program: Program  # %0: the scores Q @ K^T (Q's dtype), then the extras -> one output
    head_d: int  # D, Q's and K^T's contracted dim (a constexpr)
    head_dv: int  # Dv, V's and Y's last dim (a constexpr)
    precision: str = "tf32"  # float32 operands: tl.dot's input_precision (TF32 rounded to nearest)
    # sizes when static, for the tile heuristic: B * H, Sq, Sk
    batch_heads: int | None = None
    sq: int | None = None
    sk: int | None = None
    source_nodes: tuple[str, ...] = ()
    # the node's rank and perm_q, perm_k, perm_v, perm_y (kernel_meta repeats them)
    rank: int = 4
    perms: tuple[tuple[int, ...], ...] = ()

    @property
    def dtype(self) -> str:
        """Q's, K's and V's dtype (and Y's)."""
        return self.program.input_dtypes[0]

    @property
    def n_extras(self) -> int:
        return len(self.program.input_dtypes) - 1

    @property
    def tf32(self) -> bool:
        """Float32 operands multiplied at precision "tf32" (rounded to nearest first)."""
        return self.dtype == "f32" and self.precision == "tf32"


@dataclass(frozen=True)
class AttentionVariant:
    """One binary of a FusedAttention kernel: its tile."""

    index: int = 0
    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2

    def requires(self) -> dict[str, int]:
        return {"max_elements": MAX_ELEMENTS}

    def meta(self) -> dict[str, int]:
        return {"block_m": self.block_m, "block_n": self.block_n}

    def grid(self, sq: int, batch_heads: int) -> tuple[int, int]:
        """The launch grid, as the C++ launcher computes it."""
        return -(-sq // self.block_m), batch_heads

    @property
    def label(self) -> str:
        return f"tile {self.block_m}x{self.block_n}, {self.num_warps} warps, {self.num_stages} stages"


def attention_param_names(spec: AttentionSpec) -> list[str]:
    """Kernel parameters in launch order (docs/format.md, kind attention), without constexprs."""
    names = ["q_ptr", "k_ptr", "v_ptr", *(f"e{i}_ptr" for i in range(spec.n_extras)), "y_ptr", "H", "SQ", "SK"]
    names += ["stride_qb", "stride_qh", "stride_qm", "stride_qd", "stride_kb", "stride_kh", "stride_kd", "stride_kn",
              "stride_vb", "stride_vh", "stride_vn", "stride_vd", "stride_yb", "stride_yh", "stride_ym", "stride_yd"]
    for i in range(spec.n_extras):
        names += [f"stride_e{i}_b", f"stride_e{i}_h", f"stride_e{i}_m", f"stride_e{i}_n"]
    return names


def attention_variants(spec):  # TEMP: replaced by the generator's branch
    return (AttentionVariant(),)


def attention_candidates(spec):  # TEMP
    return [("default", attention_variants(spec))]


def generate_attention(spec, variant):  # TEMP
    raise NotImplementedError
