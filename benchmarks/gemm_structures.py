"""Which GEMM kernel structure can beat cuBLAS + BiasGelu at BERT-base's FFN1 on the H200?

`gemm_tiles.py` (twenty-first session) found the GemmEpilogue kernel (the Triton tutorial's
matmul: one program per output tile, operands loaded through pointers) at 0.57-0.77x of
cuBLAS's product alone at every BERT-base fp16 shape, whatever the tile; fused with its GELU,
FFN1 took 17.4 us against cuBLAS's 10.0 plus BiasGelu's ~6.4. This script times the same
product with the bias + erf-GELU epilogue (fp16, `relax_16bit`'s forms) in three other
structures, written here from Triton's documented features:

- ``desc``: one program per tile, A and B read through device-side TMA descriptors
  (`tl.make_tensor_descriptor`), Y stored through one (two column halves);
- ``desc-persistent``: the same in a persistent loop, one program per SM taking tiles
  SMS apart (`tl.range(..., flatten=True)`, which lets Triton overlap a tile's epilogue with the
  next tile's loads);
- ``ptr-persistent``: today's pointer loads in the persistent loop.

Each with a few tiles; timed like `gemm_tiles.py` (CUDA graph replays, operands cycled through
12 copies so that L2 is cold; error against float64). Needs torch with CUDA and triton 3.6:

    python benchmarks/gemm_structures.py --json gemm_structures.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gemm_tiles import cycled, interpreted  # noqa: E402

C_ERF = tl.constexpr(0.7071823477745056)  # RN32(1 / fp16(sqrt 2)): the relaxed erf-GELU of an fp16 export


@triton.jit
def bias_gelu(acc, bias):
    """The epilogue in fp32 on a tile: the product rounded to fp16 (as the original stores it),
    plus the bias row, erf-GELU in ORT's form."""
    h = acc.to(tl.float16).to(tl.float32) + bias[None, :].to(tl.float32)
    return (0.5 * h * (1.0 + tl.erf(h * C_ERF))).to(tl.float16)


@triton.jit
def tile_of(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Tile (pid_m, pid_n) of a linear tile id, in groups of GROUP_M tile rows (L2 reuse)."""
    in_group = GROUP_M * num_pid_n
    first_m = (tile_id // in_group) * GROUP_M
    size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
    return first_m + (tile_id % in_group) % size_m, (tile_id % in_group) // size_m


@triton.jit
def desc_kernel(a_ptr, b_ptr, bias_ptr, y_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr, NUM_SMS: tl.constexpr):
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[K, N], strides=[N, 1], block_shape=[BLOCK_K, BLOCK_N])
    y_desc = tl.make_tensor_descriptor(y_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N // 2])
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    step = NUM_SMS if PERSISTENT else num_tiles
    for tile_id in tl.range(tl.program_id(0), num_tiles, step, flatten=True):
        pid_m, pid_n = tile_of(tile_id, num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(tl.cdiv(K, BLOCK_K)):
            a = a_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            b = b_desc.load([k * BLOCK_K, pid_n * BLOCK_N])
            acc = tl.dot(a, b, acc)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N // 2)
        left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
        b0 = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
        y_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], bias_gelu(left, b0))
        b1 = tl.load(bias_ptr + offs_n + BLOCK_N // 2, mask=offs_n + BLOCK_N // 2 < N, other=0.0)
        y_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N + BLOCK_N // 2], bias_gelu(right, b1))


@triton.jit
def ptr_persistent_kernel(a_ptr, b_ptr, bias_ptr, y_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr,
                          NUM_SMS: tl.constexpr):
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    for tile_id in tl.range(tl.program_id(0), num_tiles, NUM_SMS, flatten=True):
        pid_m, pid_n = tile_of(tile_id, num_pid_m, num_pid_n, GROUP_M)
        offs_am = (pid_m * BLOCK_M + tl.arange(0, BLOCK_M)) % M
        offs_bn = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N
        offs_k = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(tl.cdiv(K, BLOCK_K)):
            a = tl.load(a_ptr + offs_am[:, None] * K + (k * BLOCK_K + offs_k)[None, :],
                        mask=(k * BLOCK_K + offs_k)[None, :] < K, other=0.0)
            b = tl.load(b_ptr + (k * BLOCK_K + offs_k)[:, None] * N + offs_bn[None, :],
                        mask=(k * BLOCK_K + offs_k)[:, None] < K, other=0.0)
            acc = tl.dot(a, b, acc)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.store(y_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :], bias_gelu(acc, bias), mask=mask)


@triton.jit
def ws_tiles(a_desc, b_desc, y_desc, bias_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr, NUM_SMS: tl.constexpr,
             STAGES: tl.constexpr):
    """Warp-specialized tiles (Triton's automatic warp specialization, which Hopper has had since
    Triton 3.5 at 4 warps): a producer warp issues the TMA loads of A and of B (K-major: [N, K],
    as the packed weights would be), the consumer warps run wgmma and the epilogue. Persistent:
    the loop over tiles is specialized (a tile's epilogue overlaps the next tile's loads); else
    the K loop of one tile a program."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    if PERSISTENT:
        for tile_id in tl.range(tl.program_id(0), num_tiles_of(M, N, BLOCK_M, BLOCK_N), NUM_SMS,
                                warp_specialize=True, num_stages=STAGES):
            pid_m, pid_n = tile_of(tile_id, num_pid_m, num_pid_n, GROUP_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k in range(k_tiles):
                a = a_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
                b = b_desc.load([pid_n * BLOCK_N, k * BLOCK_K])
                acc = tl.dot(a, b.T, acc)
            store_tile(y_desc, bias_ptr, acc, pid_m, pid_n, N, BLOCK_M, BLOCK_N)
    else:
        pid_m, pid_n = tile_of(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in tl.range(k_tiles, warp_specialize=True, num_stages=STAGES):
            a = a_desc.load([pid_m * BLOCK_M, k * BLOCK_K])
            b = b_desc.load([pid_n * BLOCK_N, k * BLOCK_K])
            acc = tl.dot(a, b.T, acc)
        store_tile(y_desc, bias_ptr, acc, pid_m, pid_n, N, BLOCK_M, BLOCK_N)


@triton.jit
def store_tile(y_desc, bias_ptr, acc, pid_m, pid_n, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The epilogue (bias + erf-GELU in fp16) of one output tile, stored through its descriptor."""
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    bias = tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0)
    y_desc.store([pid_m * BLOCK_M, pid_n * BLOCK_N], bias_gelu(acc, bias))


@triton.jit
def num_tiles_of(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    return tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)


@triton.jit
def desc_ws_kernel(a_ptr, bt_ptr, bias_ptr, y_ptr, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr, NUM_SMS: tl.constexpr,
                   STAGES: tl.constexpr):
    """`ws_tiles` through device-side descriptors (what an AOT launcher without host-side
    cuTensorMapEncode would run; each program writes its three descriptors first)."""
    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1], block_shape=[BLOCK_M, BLOCK_K])
    b_desc = tl.make_tensor_descriptor(bt_ptr, shape=[N, K], strides=[K, 1], block_shape=[BLOCK_N, BLOCK_K])
    y_desc = tl.make_tensor_descriptor(y_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
    ws_tiles(a_desc, b_desc, y_desc, bias_ptr, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, PERSISTENT, NUM_SMS,
             STAGES)


@triton.jit
def host_ws_kernel(a_desc, b_desc, bias_ptr, y_desc, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, PERSISTENT: tl.constexpr, NUM_SMS: tl.constexpr,
                   STAGES: tl.constexpr):
    """`ws_tiles` through descriptors encoded on the host (passed as kernel parameters)."""
    ws_tiles(a_desc, b_desc, y_desc, bias_ptr, M, N, K, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, PERSISTENT, NUM_SMS,
             STAGES)


STRUCTURES = {"desc": (desc_kernel, False), "desc-persistent": (desc_kernel, True),
              "ptr-persistent": (ptr_persistent_kernel, True)}
# the warp-specialized ones: (kernel, persistent, descriptors made on the host); B passed K-major
WS_STRUCTURES = {"desc-ws": (desc_ws_kernel, False, False), "desc-persistent-ws": (desc_ws_kernel, True, False),
                 "host-ws": (host_ws_kernel, False, True), "host-persistent-ws": (host_ws_kernel, True, True)}
TILES = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (64, 128, 64, 4, 4),
         (128, 64, 64, 4, 4), (64, 256, 64, 4, 3)]
# Hopper's warp specialization takes 4 warps (at 8 Triton leaves the loop unspecialized)
WS_TILES = [(128, 128, 64, 4, 3), (128, 128, 64, 4, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4),
            (128, 256, 64, 4, 3), (64, 256, 64, 4, 3), (128, 128, 128, 4, 3)]
SHAPES = {"ffn1_b8": (1024, 768, 3072), "ffn1_b1": (128, 768, 3072), "qkv_b8_gelu": (1024, 768, 2304),
          "proj_b8_gelu": (1024, 768, 768), "ffn2_b8_gelu": (1024, 3072, 768)}


def ws_launcher(kern, persistent: bool, host: bool, m: int, k: int, n: int, tile: tuple, sms: int):
    """A callable (x, w_t, b, y) launching a warp-specialized structure at one tile, w_t = W^T
    ([N, K], contiguous); with host descriptors, encoded at each call (as a launcher would)."""
    bm, bn, bk, warps, stages = tile
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    grid = (min(sms, tiles) if persistent else tiles,)
    meta = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, PERSISTENT=persistent, NUM_SMS=sms, STAGES=stages,
                num_warps=warps)

    def launch(x, w_t, b, y):
        if host:
            from triton.tools.tensor_descriptor import TensorDescriptor
            kern[grid](TensorDescriptor.from_tensor(x, [bm, bk]), TensorDescriptor.from_tensor(w_t, [bn, bk]), b,
                       TensorDescriptor.from_tensor(y, [bm, bn]), m, n, k, **meta)
        else:
            kern[grid](x, w_t, b, y, m, n, k, **meta)
    return launch


def dry_run() -> list[dict]:
    """CPU, under Triton's interpreter (TRITON_INTERPRET=1): each structure on a 48 x 64 x 96
    product with 32 x 32 tiles (three programs where persistent), against float64; raises where
    the error exceeds fp16's rounding of the output (2^-10 of its largest value)."""
    m, k, n = 48, 64, 96
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(m, k, generator=gen).half()
    w = (torch.randn(k, n, generator=gen) / math.sqrt(k)).half()
    b = (torch.randn(n, generator=gen) * 0.1).half()
    h = x.double() @ w.double() + b.double()
    ref = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8))
    rows = []
    for name, (kern, persistent) in STRUCTURES.items():
        y = torch.zeros(m, n, dtype=torch.float16)
        tiles = triton.cdiv(m, 32) * triton.cdiv(n, 32)
        kern[(3 if persistent else tiles,)](x, w, b, y, m, n, k, BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2,
                                            PERSISTENT=persistent, NUM_SMS=3)
        rows.append(_checked(name, y, ref))
    for name, (kern, persistent, host) in WS_STRUCTURES.items():
        y = torch.zeros(m, n, dtype=torch.float16)
        ws_launcher(kern, persistent, host, m, k, n, (32, 32, 32, 4, 2), 3)(x, w.t().contiguous(), b, y)
        rows.append(_checked(name, y, ref))
    return rows


def _checked(name: str, y, ref) -> dict:
    err, bound = float((y.double() - ref).abs().max()), float(ref.abs().max()) * 2.0**-10
    print(f"{name:20} err {err:.2g} (bound {bound:.2g})")
    if not err <= bound:
        raise AssertionError(f"{name}: error {err:.3g} above {bound:.3g}")
    return {"kernel": name, "err": err, "bound": bound}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--copies", type=int, default=12)
    ap.add_argument("--rep", type=int, default=50)
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated, of " + ", ".join(SHAPES))
    ap.add_argument("--structures", default="all", help="'ws' for the warp-specialized ones only")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU: run each structure small under Triton's interpreter (TRITON_INTERPRET=1)")
    args = ap.parse_args()
    if args.dry_run:
        interpreted(dry_run)
        return
    from triton.testing import do_bench_cudagraph

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    rows = []
    for shape in args.shapes.split(","):
        m, k, n = SHAPES[shape]
        gen = torch.Generator(device="cuda").manual_seed(3)
        sets = [((torch.randn(m, k, generator=gen, device="cuda")).half(),
                 (torch.randn(k, n, generator=gen, device="cuda") / math.sqrt(k)).half(),
                 (torch.randn(n, generator=gen, device="cuda") * 0.1).half()) for _ in range(args.copies)]
        x, w, b = sets[0]
        h = x.double() @ w.double() + b.double()
        ref = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))

        mm = do_bench_cudagraph(cycled(sets, lambda x, w, b: torch.mm(x, w)), rep=args.rep,
                                return_mode="median") * 1e3

        def time_kernel(label, launch, sets, outs, shape=shape, m=m, k=k, n=n, ref=ref, mm=mm):
            """One kernel checked against float64 and timed (a row), or its error (a row too)."""
            try:
                launch(*sets[0], outs[0])
                torch.cuda.synchronize()
                err = float((outs[0].double() - ref).abs().max())
                us = do_bench_cudagraph(cycled(sets, launch, outs), rep=args.rep, return_mode="median") * 1e3
            except Exception as e:  # noqa: BLE001 -- reported
                rows.append({"shape": shape, "kernel": label, "error": f"{type(e).__name__}: {str(e)[:300]}"})
                print(shape, label, "ERROR", rows[-1]["error"], flush=True)
                return
            rows.append({"shape": shape, "m": m, "k": k, "n": n, "kernel": label, "us": us, "err": err,
                         "cublas_mm_us": mm, "tflops": 2.0 * m * n * k / (us * 1e-6) / 1e12})
            print(f"{shape:12} {label:36} {us:7.2f} us {rows[-1]['tflops']:5.0f} TF/s  cuBLAS mm {mm:6.2f} "
                  f"({mm / us:.2f}x)  err {err:.2g}", flush=True)
        # ORT's MatMul + BiasGelu, as torch: the product, then bias + exact GELU in one kernel is not
        # available, so the peer here is cuBLAS's product alone (add BiasGelu's CUPTI 6.4 us at b8)
        for name, (kern, persistent) in (STRUCTURES.items() if args.structures == "all" else ()):
            for bm, bn, bk, w_, s in TILES:
                label = f"{name} {bm}x{bn}x{bk} w{w_} s{s}"
                tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
                grid = (min(sms, tiles) if persistent else tiles,)
                outs = [torch.empty(m, n, dtype=torch.float16, device="cuda") for _ in sets]

                def launch(x, w, b, y, kern=kern, grid=grid, bm=bm, bn=bn, bk=bk, w_=w_, s=s, p=persistent, m=m, n=n,
                           k=k):
                    kern[grid](x, w, b, y, m, n, k, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, PERSISTENT=p,
                               NUM_SMS=sms, num_warps=w_, num_stages=s)
                time_kernel(label, launch, sets, outs)
        lt = do_bench_cudagraph(cycled(sets, lambda x, w, b: torch._addmm_activation(b, x, w, use_gelu=True)),
                                rep=args.rep, return_mode="median") * 1e3
        lt_err = float((torch._addmm_activation(b, x, w, use_gelu=True).double() - ref).abs().max())
        rows.append({"shape": shape, "m": m, "k": k, "n": n, "kernel": "cublasLt bias+gelu(tanh)", "us": lt,
                     "err": lt_err, "cublas_mm_us": mm})
        print(f"{shape:12} {'cublasLt bias + tanh-GELU epilogue':36} {lt:7.2f} us  cuBLAS mm {mm:6.2f}  "
              f"err {lt_err:.2g}", flush=True)
        ws_sets = [(x, w.t().contiguous(), b) for x, w, b in sets]
        for name, (kern, persistent, host) in WS_STRUCTURES.items():
            for tile in WS_TILES:
                label = f"{name} {tile[0]}x{tile[1]}x{tile[2]} w{tile[3]} s{tile[4]}"
                outs = [torch.empty(m, n, dtype=torch.float16, device="cuda") for _ in ws_sets]
                time_kernel(label, ws_launcher(kern, persistent, host, m, k, n, tile, sms), ws_sets, outs)
        if args.json:  # after every shape: a run cut off keeps what it timed
            args.json.write_text(json.dumps({"rows": rows}, indent=1))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=1))


if __name__ == "__main__":
    main()
