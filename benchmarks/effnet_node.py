"""EfficientNet-B0's 80 -> 480 expansion conv at 14², in the whole model and in a one-block
model: what onnxfuse writes for that node in each (BENCHMARKS.md, "Batch 1: where the time
goes", the open question of the 28 µs node).

torchvision's EfficientNet-B0 is rebuilt here layer by layer (same stages, widths, kernel
sizes, strides, squeeze-excite and SiLU as torchvision 0.26's `efficientnet_b0`), so it runs
where torchvision is not installed; random weights (seed 0), BatchNorm calibrated as
models/build.py does. The one-block model is the MBConv 80 -> 480 -> 80 (3x3 depthwise,
residual) of stage 4 on a [N, 80, 14, 14] input.

Both are optimized as `onnxfuse optimize --no-tune --layout nhwc --target sm_90 --shape
x=1,...` would (kernels compiled here with Triton, no GPU needed), and for each 80 -> 480
1x1 FusedConv at 14² the script prints its kernel_meta (variants, tiles), its precision
and rounding, the layouts of its input and output, its program, the nodes around it, and
the variant the library's launcher picks at M = 196 (`launcher_choice`, the rule of
csrc/kinds/conv_cuda.cc).

    python benchmarks/effnet_node.py [--out DIR] [--sms 132]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import onnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models import build as mb  # noqa: E402
from onnxfuse.kinds.conv import launcher_choice  # noqa: E402

# torchvision's efficientnet_b0 stages: (expand ratio, kernel, stride, in, out, layers)
STAGES = ((1, 3, 1, 32, 16, 1), (6, 3, 2, 16, 24, 2), (6, 5, 2, 24, 40, 2), (6, 3, 2, 40, 80, 3),
          (6, 5, 1, 80, 112, 3), (6, 5, 2, 112, 192, 4), (6, 3, 1, 192, 320, 1))


def _modules():
    torch = mb._import_torch()
    nn = torch.nn

    def conv_bn(c_in, c_out, k, stride=1, groups=1, act=True):
        layers = [nn.Conv2d(c_in, c_out, k, stride, (k - 1) // 2, groups=groups, bias=False), nn.BatchNorm2d(c_out)]
        return nn.Sequential(*layers, *([nn.SiLU()] if act else []))

    class SqueezeExcite(nn.Module):
        def __init__(self, c, squeeze):
            super().__init__()
            self.fc1, self.fc2 = nn.Conv2d(c, squeeze, 1), nn.Conv2d(squeeze, c, 1)

        def forward(self, x):
            s = torch.nn.functional.adaptive_avg_pool2d(x, 1)
            return x * torch.sigmoid(self.fc2(torch.nn.functional.silu(self.fc1(s))))

    class MBConv(nn.Module):
        def __init__(self, expand, k, stride, c_in, c_out):
            super().__init__()
            e = c_in * expand
            self.residual = stride == 1 and c_in == c_out
            self.block = nn.Sequential(*([conv_bn(c_in, e, 1)] if expand != 1 else []),
                                       conv_bn(e, e, k, stride, groups=e),
                                       SqueezeExcite(e, max(1, c_in // 4)),
                                       conv_bn(e, c_out, 1, act=False))

        def forward(self, x):
            y = self.block(x)
            return y + x if self.residual else y

    class EfficientNetB0(nn.Module):
        def __init__(self):
            super().__init__()
            blocks = [conv_bn(3, 32, 3, 2)]
            for expand, k, stride, c_in, c_out, n in STAGES:
                for i in range(n):
                    blocks.append(MBConv(expand, k, stride if i == 0 else 1, c_in if i == 0 else c_out, c_out))
            blocks.append(conv_bn(320, 1280, 1))
            self.features = nn.Sequential(*blocks)
            self.classifier = nn.Linear(1280, 1000)

        def forward(self, x):
            x = torch.nn.functional.adaptive_avg_pool2d(self.features(x), 1)
            return self.classifier(torch.flatten(x, 1))

    return torch, EfficientNetB0, MBConv


def models(seed: int = 0) -> dict[str, onnx.ModelProto]:
    """"full": EfficientNet-B0 for x [N, 3, 224, 224]; "block": the 80 -> 480 MBConv on
    x [N, 80, 14, 14]."""
    torch, EfficientNetB0, MBConv = _modules()
    torch.manual_seed(seed)
    full = mb.calibrate_batchnorm(EfficientNetB0(), seed)
    torch.manual_seed(seed)
    block = MBConv(6, 3, 1, 80, 80).eval()
    return {"full": mb.export_torch(full, (torch.randn(2, 3, 224, 224),), ["x"], ["y"]),
            "block": mb.export_torch(block, (torch.randn(2, 80, 14, 14),), ["x"], ["y"])}


def _attrs(n: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}


def expansions(model: onnx.ModelProto, c: int = 80, k: int = 480) -> list[dict]:
    """Every FusedConv 1x1 of c -> k channels in an optimized model, with what surrounds it."""
    inits = {t.name: tuple(t.dims) for t in model.graph.initializer}
    producer = {o: n for n in model.graph.node for o in n.output}
    readers: dict[str, list] = {}
    for n in model.graph.node:
        for x in n.input:
            readers.setdefault(x, []).append(n)
    out = []
    for n in model.graph.node:
        if n.op_type != "FusedConv":
            continue
        a = _attrs(n)
        w = inits.get(n.input[1])
        krsc = a.get("w_layout", b"RSCK") == b"KRSC"
        ck = (w[3], w[0]) if krsc else (w[2], w[3])
        if tuple(a["kernel_shape"]) != (1, 1) or ck != (c, k):
            continue
        meta = json.loads(a["kernel_meta"])
        src = producer.get(n.input[0])
        out.append({
            "node": n.name, "kernel": meta["name"], "x_layout": a.get("x_layout", b"NCHW").decode(),
            "y_layout": a.get("y_layout", b"NCHW").decode(), "w_layout": a.get("w_layout", b"RSCK").decode(),
            "program": a["program"].decode(), "inputs": list(n.input),
            "x_from": f"{src.op_type} {src.name}" if src is not None else "graph input",
            "y_to": [f"{r.op_type} {r.name}" for r in readers.get(n.output[0], [])],
            "variants": meta["variants"],
            "kernel_meta_keys": sorted(meta),
            "choice_m196": launcher_choice(meta, 196, k),
            "choice_m49": launcher_choice(meta, 49, k),
            "choice_m1": launcher_choice(meta, 1, k),
        })
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="folder for the models (default: a temporary one)")
    ap.add_argument("--target", default="sm_90")
    args = ap.parse_args(argv)
    from onnxfuse.pipeline import build_options, optimize_model

    folder = args.out or Path(tempfile.mkdtemp(prefix="effnet_node_"))
    folder.mkdir(parents=True, exist_ok=True)
    report = {}
    for name, m in models().items():
        onnx.save(m, str(folder / f"{name}.onnx"))
        shape = {"x": (1, 3, 224, 224) if name == "full" else (1, 80, 14, 14)}
        options = build_options(target=args.target, layout="nhwc", tune="off", shapes=shape)
        r = optimize_model(m, None, options=options)
        onnx.save(r.model, str(folder / f"{name}.opt.onnx"))
        report[name] = expansions(r.model)
        ops: dict[str, int] = {}
        for n in r.model.graph.node:
            ops[n.op_type] = ops.get(n.op_type, 0) + 1
        report[name + "_ops"] = ops
    print(json.dumps(report, indent=1))
    (folder / "effnet_node.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"models and effnet_node.json in {folder}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
