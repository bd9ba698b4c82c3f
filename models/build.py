"""Build the models used by tests, examples and benchmarks: python -m models.build [--out DIR] [NAME ...]

    python -m models.build                       # the small ones (default), into models/build/
    python -m models.build --out DIR bench       # the benchmark set: Relu+MaxPool, Conv+Relu, ...
    python -m models.build torchvision           # resnet18, vgg11, mobilenet_v3_small (needs torchvision)
    python -m models.build --out DIR cnn         # the CNN suite: 10 torchvision archs and a UNet
    python -m models.build all                   # everything
    python -m models.build conv_relu vgg_stack   # by name (with or without .onnx)

Each model has a dynamic batch dimension "N" and opset 17 or newer. The ones committed to the
repository are small (example.onnx, a few hundred KB at most); big ones are made on demand
(models/build/ is git-ignored). Weights are seeded random numbers; the convolutional models'
initializers are named after the state_dict keys of the PyTorch module `torch_module` builds,
so the same weights run in PyTorch (benchmarks/compare.py). The torchvision models and the
UNet are exported from a seeded module through torch.onnx (TorchScript exporter, opset 17);
`cnn_module(arch)` gives that module again, with the same weights.
"""

from __future__ import annotations

import argparse
import io
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

HERE = Path(__file__).resolve().parent
N = helper.make_node
F = TensorProto.FLOAT


def _model(name: str, nodes, inputs, outputs, inits=(), opset: int = 17) -> onnx.ModelProto:
    g = helper.make_graph(nodes, name, inputs, outputs, list(inits))
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], producer_name="onnxfuse-models")
    m.ir_version = 8
    onnx.checker.check_model(m, full_check=True)
    return m


def _const(name: str, value) -> onnx.TensorProto:
    return numpy_helper.from_array(np.asarray(value, dtype=np.float32), name)


def mul_chain(r: int, width: int = 1024) -> onnx.ModelProto:
    """y = x * 2 repeated r times (the intensity sweep's workload)."""
    names = ["x"] + [f"t{i}" for i in range(1, r)] + ["y"]
    nodes = [N("Mul", [names[i], "two"], [names[i + 1]]) for i in range(r)]
    return _model(f"mul_chain_{r}", nodes, [helper.make_tensor_value_info("x", F, ["N", width])],
                  [helper.make_tensor_value_info("y", F, ["N", width])], [_const("two", 2.0)])


def cos_cos(width: int = 1024) -> onnx.ModelProto:
    nodes = [N("Cos", ["x"], ["c"]), N("Cos", ["c"], ["y"])]
    return _model("cos_cos", nodes, [helper.make_tensor_value_info("x", F, ["N", width])],
                  [helper.make_tensor_value_info("y", F, ["N", width])])


def gelu_erf(width: int = 1024) -> onnx.ModelProto:
    """GELU as exporters write it: x * 0.5 * (1 + erf(x / sqrt(2)))."""
    nodes = [N("Div", ["x", "sqrt2"], ["d"]), N("Erf", ["d"], ["e"]), N("Add", ["e", "one"], ["a"]),
             N("Mul", ["x", "a"], ["m"]), N("Mul", ["m", "half"], ["y"])]
    return _model("gelu_erf", nodes, [helper.make_tensor_value_info("x", F, ["N", width])],
                  [helper.make_tensor_value_info("y", F, ["N", width])],
                  [_const("sqrt2", np.sqrt(2.0)), _const("one", 1.0), _const("half", 0.5)])


def _mlp_nodes() -> list[onnx.NodeProto]:
    """h0 -> MatMul, bias, GELU written out around Erf, MatMul, bias, residual Add of x -> y."""
    return [
        N("MatMul", ["h0", "fc1.weight"], ["h1"], name="fc1/matmul"),
        N("Add", ["h1", "fc1.bias"], ["h2"], name="fc1/bias"),
        N("Div", ["h2", "sqrt2"], ["g0"], name="gelu/div"),
        N("Erf", ["g0"], ["g1"], name="gelu/erf"),
        N("Add", ["g1", "one"], ["g2"], name="gelu/add"),
        N("Mul", ["h2", "g2"], ["g3"], name="gelu/mul"),
        N("Mul", ["g3", "half"], ["g4"], name="gelu/half"),
        N("MatMul", ["g4", "fc2.weight"], ["h3"], name="fc2/matmul"),
        N("Add", ["h3", "fc2.bias"], ["h4"], name="fc2/bias"),
        N("Add", ["h4", "x"], ["y"], name="residual"),
    ]


def _mlp_weights(seed: int, dim: int, hidden: int) -> list:
    """The seeded weights of the MLP blocks: fc1/fc2 weights ([in, out]) and biases, the
    LayerNorm scale and bias."""
    rng = np.random.default_rng(seed)
    w1 = (rng.standard_normal((dim, hidden)) / np.sqrt(dim)).astype(np.float32)
    w2 = (rng.standard_normal((hidden, dim)) / np.sqrt(hidden)).astype(np.float32)
    return [
        numpy_helper.from_array(w1, "fc1.weight"), numpy_helper.from_array(w2, "fc2.weight"),
        _const("fc1.bias", rng.standard_normal(hidden) * 0.1), _const("fc2.bias", rng.standard_normal(dim) * 0.1),
        _const("ln.weight", 1 + rng.standard_normal(dim) * 0.1), _const("ln.bias", rng.standard_normal(dim) * 0.1),
    ]


def example(dim: int = 64, hidden: int = 256, seed: int = 0) -> onnx.ModelProto:
    """A transformer MLP block as a PyTorch export writes it: LayerNorm written out, MatMul,
    bias, GELU around Erf, MatMul, bias, residual Add. The bundled example model."""
    inits = _mlp_weights(seed, dim, hidden) + [
        _const("eps", 1e-5), _const("sqrt2", np.sqrt(2.0)), _const("one", 1.0), _const("half", 0.5)]
    nodes = [
        N("ReduceMean", ["x"], ["mean"], axes=[-1], name="ln/mean"),
        N("Sub", ["x", "mean"], ["xc"], name="ln/sub"),
        N("Mul", ["xc", "xc"], ["sq"], name="ln/square"),
        N("ReduceMean", ["sq"], ["var"], axes=[-1], name="ln/var"),
        N("Add", ["var", "eps"], ["var_eps"], name="ln/add_eps"),
        N("Sqrt", ["var_eps"], ["std"], name="ln/sqrt"),
        N("Div", ["xc", "std"], ["xn"], name="ln/div"),
        N("Mul", ["xn", "ln.weight"], ["xs"], name="ln/scale"),
        N("Add", ["xs", "ln.bias"], ["h0"], name="ln/shift"),
        *_mlp_nodes(),
    ]
    return _model("mlp_block", nodes, [helper.make_tensor_value_info("x", F, ["N", 16, dim])],
                  [helper.make_tensor_value_info("y", F, ["N", 16, dim])], inits)


def activation_block(channels: int = 128, size: int = 64, seed: int = 0) -> onnx.ModelProto:
    """The activation tail of a CNN block as exporters write it (YOLO, diffusion UNets): SiLU
    written as x * Sigmoid(x), a per-channel scale and shift, a residual Add and a Clip.
    Six elementwise nodes, each a full read and write of the activation: where fusion wins
    on any machine, CPU included. The README's first example."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array((1 + 0.1 * rng.standard_normal((1, channels, 1, 1))).astype(np.float32), "scale"),
             numpy_helper.from_array((0.1 * rng.standard_normal((1, channels, 1, 1))).astype(np.float32), "shift"),
             _const("lo", -6.0), _const("hi", 6.0)]
    nodes = [
        N("Sigmoid", ["x"], ["gate"], name="silu/sigmoid"),
        N("Mul", ["x", "gate"], ["silu"], name="silu/mul"),
        N("Mul", ["silu", "scale"], ["scaled"], name="affine/scale"),
        N("Add", ["scaled", "shift"], ["shifted"], name="affine/shift"),
        N("Add", ["shifted", "skip"], ["summed"], name="residual"),
        N("Clip", ["summed", "lo", "hi"], ["y"], name="clip"),
    ]
    image = ["N", channels, size, size]
    return _model("activation_block", nodes, [helper.make_tensor_value_info("x", F, image),
                                              helper.make_tensor_value_info("skip", F, image)],
                  [helper.make_tensor_value_info("y", F, image)], inits)


SMALL = {
    "example.onnx": example,
    "activation_block.onnx": activation_block,
    "mul_chain_8.onnx": lambda: mul_chain(8),
    "cos_cos.onnx": cos_cos,
    "gelu_erf.onnx": gelu_erf,
}


# ---------------------------------------------------------------------------------------
# Benchmark models (DESIGN.md's peers table): 32x64x112x112 activations by default
# ---------------------------------------------------------------------------------------

def _conv_weights(rng: np.random.Generator, c_out: int, c_in: int, k: int = 3) -> tuple[np.ndarray, np.ndarray]:
    w = rng.standard_normal((c_out, c_in, k, k)) * np.sqrt(2.0 / (c_in * k * k))
    b = rng.standard_normal(c_out) * 0.1
    return w.astype(np.float32), b.astype(np.float32)


def _image_io(channels: int, size: int, out_channels: int, out_size: int):
    return ([helper.make_tensor_value_info("x", F, ["N", channels, size, size])],
            [helper.make_tensor_value_info("y", F, ["N", out_channels, out_size, out_size])])


def relu_maxpool(channels: int = 64, size: int = 112) -> onnx.ModelProto:
    """Relu then MaxPool 2x2 stride 2."""
    nodes = [N("Relu", ["x"], ["r"], name="relu"),
             N("MaxPool", ["r"], ["y"], kernel_shape=[2, 2], strides=[2, 2], name="pool")]
    return _model("relu_maxpool", nodes, *_image_io(channels, size, channels, size // 2))


def conv_relu(channels: int = 64, size: int = 112, pool: bool = False, seed: int = 0) -> onnx.ModelProto:
    """Conv 3x3 (padding 1, bias) then Relu, then MaxPool 2x2 when pool. Initializers
    '0.weight', '0.bias' as in torch.nn.Sequential(Conv2d, ReLU[, MaxPool2d])."""
    w, b = _conv_weights(np.random.default_rng(seed), channels, channels)
    nodes = [N("Conv", ["x", "0.weight", "0.bias"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], name="conv"),
             N("Relu", ["c"], ["r" if pool else "y"], name="relu")]
    if pool:
        nodes.append(N("MaxPool", ["r"], ["y"], kernel_shape=[2, 2], strides=[2, 2], name="pool"))
    name = "conv_relu_maxpool" if pool else "conv_relu"
    return _model(name, nodes, *_image_io(channels, size, channels, size // 2 if pool else size),
                  [numpy_helper.from_array(w, "0.weight"), numpy_helper.from_array(b, "0.bias")])


def conv_relu_maxpool(channels: int = 64, size: int = 112, seed: int = 0) -> onnx.ModelProto:
    return conv_relu(channels, size, pool=True, seed=seed)


def vgg_stack(blocks: int = 4, channels: int = 64, in_channels: int = 3, size: int = 224,
              seed: int = 0) -> onnx.ModelProto:
    """VGG-style stack: blocks x [Conv3x3(channels) - Relu - MaxPool2x2] on an image. Conv i's
    initializers are '{3i}.weight' and '{3i}.bias' (torch.nn.Sequential numbering)."""
    rng = np.random.default_rng(seed)
    nodes, inits, cur, c_in = [], [], "x", in_channels
    for i in range(blocks):
        w, b = _conv_weights(rng, channels, c_in)
        k = 3 * i
        inits += [numpy_helper.from_array(w, f"{k}.weight"), numpy_helper.from_array(b, f"{k}.bias")]
        out = "y" if i == blocks - 1 else f"p{i}"
        nodes += [N("Conv", [cur, f"{k}.weight", f"{k}.bias"], [f"c{i}"], kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                    name=f"block{i}/conv"),
                  N("Relu", [f"c{i}"], [f"r{i}"], name=f"block{i}/relu"),
                  N("MaxPool", [f"r{i}"], [out], kernel_shape=[2, 2], strides=[2, 2], name=f"block{i}/pool")]
        cur, c_in = out, channels
    g_in, g_out = _image_io(in_channels, size, channels, size >> blocks)
    return _model("vgg_stack", nodes, g_in, g_out, inits)


def mlp_block(tokens: int = 128, dim: int = 768, hidden: int = 3072, seed: int = 0) -> onnx.ModelProto:
    """A transformer MLP block as torch.onnx exports it at opset 17: LayerNormalization,
    MatMul + bias, GELU written out around Erf, MatMul + bias, residual Add. Initializers:
    'ln.weight', 'ln.bias', 'fc1.weight' ([dim, hidden], the transpose of nn.Linear's),
    'fc1.bias', 'fc2.weight', 'fc2.bias'."""
    inits = _mlp_weights(seed, dim, hidden) + [_const("sqrt2", np.sqrt(2.0)), _const("one", 1.0),
                                                _const("half", 0.5)]
    nodes = [
        N("LayerNormalization", ["x", "ln.weight", "ln.bias"], ["h0"], axis=-1, epsilon=1e-5, name="ln"),
        *_mlp_nodes(),
    ]
    return _model("mlp_block", nodes, [helper.make_tensor_value_info("x", F, ["N", tokens, dim])],
                  [helper.make_tensor_value_info("y", F, ["N", tokens, dim])], inits)


BENCH = {
    "relu_maxpool.onnx": relu_maxpool,
    "conv_relu.onnx": conv_relu,
    "conv_relu_maxpool.onnx": conv_relu_maxpool,
    "vgg_stack.onnx": vgg_stack,
    "mlp_block.onnx": mlp_block,
}


# ---------------------------------------------------------------------------------------
# PyTorch: the same computations as modules, and torchvision architectures exported to ONNX
# ---------------------------------------------------------------------------------------

class TorchUnavailable(Exception):
    """torch or torchvision cannot be imported here."""


def _import_torch():
    try:
        import torch
    except ImportError:
        raise TorchUnavailable("torch is not installed") from None
    return torch


def _import_torchvision():
    _import_torch()
    try:
        import torchvision
    except Exception as e:  # ImportError, or a torch/torchvision version mismatch at import
        raise TorchUnavailable(f"torchvision cannot be imported ({type(e).__name__}: {e})") from None
    return torchvision


def torch_module(name: str, model: onnx.ModelProto):
    """The PyTorch module computing what the ONNX benchmark model `name` computes, with its
    weights (eval mode, CPU, fp32)."""
    torch = _import_torch()
    nn = torch.nn
    name = name.removesuffix(".onnx")
    inits = {t.name: torch.from_numpy(numpy_helper.to_array(t).copy()) for t in model.graph.initializer}
    if name == "relu_maxpool":
        return nn.Sequential(nn.ReLU(), nn.MaxPool2d(2)).eval()
    if name in ("conv_relu", "conv_relu_maxpool", "vgg_stack"):
        layers = []
        for key in sorted((k for k in inits if k.endswith(".weight")), key=lambda k: int(k.split(".")[0])):
            w = inits[key]
            layers += [nn.Conv2d(w.shape[1], w.shape[0], 3, padding=1), nn.ReLU()]
            if name != "conv_relu":
                layers.append(nn.MaxPool2d(2))
        m = nn.Sequential(*layers)
        m.load_state_dict(inits)
        return m.eval()
    if name == "mlp_block":
        dim, hidden = inits["fc1.weight"].shape

        class MLPBlock(nn.Module):
            def __init__(self):
                super().__init__()
                self.ln = nn.LayerNorm(dim, eps=1e-5)
                self.fc1 = nn.Linear(dim, hidden)
                self.fc2 = nn.Linear(hidden, dim)

            def forward(self, x):
                return x + self.fc2(nn.functional.gelu(self.fc1(self.ln(x))))

        m = MLPBlock()
        m.load_state_dict({k: (v.t().contiguous() if k in ("fc1.weight", "fc2.weight") else v)
                           for k, v in inits.items() if k.split(".")[0] in ("ln", "fc1", "fc2")})
        return m.eval()
    raise KeyError(f"no PyTorch module for {name!r}")


TORCHVISION_ARCHS = ("resnet18", "vgg11", "mobilenet_v3_small")


def torchvision_module(arch: str, seed: int = 0):
    """A torchvision architecture with seeded random weights, in eval mode (BatchNorm statistics
    as initialized; cnn_module calibrates them)."""
    torchvision = _import_torchvision()
    torch = _import_torch()
    torch.manual_seed(seed)
    return getattr(torchvision.models, arch)(weights=None).eval()


def export_torch(module, example_inputs: tuple, input_names: list[str], output_names: list[str],
                 opset: int = 17) -> onnx.ModelProto:
    """Export a module with torch.onnx (TorchScript exporter), the leading dimension of every
    input and output dynamic ("N")."""
    torch = _import_torch()
    f = io.BytesIO()
    kwargs = dict(opset_version=opset, input_names=input_names, output_names=output_names,
                  dynamic_axes={n: {0: "N"} for n in [*input_names, *output_names]})
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(module, example_inputs, f, dynamo=False, **kwargs)
        except TypeError:  # a torch without the dynamo switch: TorchScript is its only exporter
            torch.onnx.export(module, example_inputs, f, **kwargs)
    m = onnx.load_from_string(f.getvalue())
    m.producer_name = "onnxfuse-models"
    return m


def torchvision_model(arch: str, size: int = 224, seed: int = 0) -> onnx.ModelProto:
    """torchvision `arch` with seeded random weights, exported for input x [N, 3, size, size]."""
    torch = _import_torch()
    module = torchvision_module(arch, seed)
    return export_torch(module, (torch.randn(2, 3, size, size),), ["x"], ["y"])


def unet_module(seed: int = 0, base: int = 32, classes: int = 2, bilinear: bool = False):
    """A standard UNet (Ronneberger et al.) with seeded random weights, in eval mode: four down
    levels of [Conv3x3-BN-ReLU] x2 then MaxPool 2x2, a bottleneck, four up levels of a 2x2
    ConvTranspose (or bilinear Upsample and a 1x1 Conv), skip Concat, [Conv3x3-BN-ReLU] x2,
    then a 1x1 Conv head. Widths base * 2**level (32 ... 512); about 7.8M parameters at base 32.
    Convs are He-initialized (fan-in, ReLU) so activations keep their scale through the depth."""
    torch = _import_torch()
    nn = torch.nn

    def double_conv(c_in: int, c_out: int):
        return nn.Sequential(nn.Conv2d(c_in, c_out, 3, padding=1, bias=False), nn.BatchNorm2d(c_out),
                             nn.ReLU(inplace=True), nn.Conv2d(c_out, c_out, 3, padding=1, bias=False),
                             nn.BatchNorm2d(c_out), nn.ReLU(inplace=True))

    class Up(nn.Module):
        def __init__(self, c_in: int, c_out: int):
            super().__init__()
            if bilinear:
                self.up = nn.Sequential(nn.Upsample(scale_factor=2, mode="bilinear", align_corners=False),
                                        nn.Conv2d(c_in, c_out, 1))
            else:
                self.up = nn.ConvTranspose2d(c_in, c_out, 2, stride=2)
            self.conv = double_conv(2 * c_out, c_out)

        def forward(self, x, skip):
            return self.conv(torch.cat([skip, self.up(x)], dim=1))

    class UNet(nn.Module):
        def __init__(self):
            super().__init__()
            widths = [base * 2**i for i in range(5)]
            self.inc = double_conv(3, widths[0])
            self.downs = nn.ModuleList(nn.Sequential(nn.MaxPool2d(2), double_conv(widths[i], widths[i + 1]))
                                       for i in range(4))
            self.ups = nn.ModuleList(Up(widths[i + 1], widths[i]) for i in reversed(range(4)))
            self.head = nn.Conv2d(widths[0], classes, 1)

        def forward(self, x):
            skips = [self.inc(x)]
            for down in self.downs:
                skips.append(down(skips[-1]))
            x = skips.pop()
            for up in self.ups:
                x = up(x, skips.pop())
            return self.head(x)

    torch.manual_seed(seed)
    m = UNet()
    for mod in m.modules():
        if isinstance(mod, nn.Conv2d | nn.ConvTranspose2d):
            nn.init.kaiming_normal_(mod.weight, nonlinearity="relu")
    return m.eval()


def calibrate_batchnorm(module, seed: int = 0, size: int = 128, batch: int = 8):
    """Set every BatchNorm's running statistics to its batch statistics over `batch` seeded
    random images (uniform in [0, 1), size x size), the rest of the module in eval mode.
    With random weights and the initial statistics (mean 0, variance 1) activations shrink or
    grow with depth (torchvision's MobileNetV2 ends near 1e-9, EfficientNet-B0 near 1e-14, zero
    in fp16); calibrated, every BatchNorm output is about unit scale, as in a trained net."""
    torch = _import_torch()
    bns = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    module.eval()
    if not bns:
        return module
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None      # a cumulative average: one pass sets the batch statistics
        bn.train()
    x = torch.rand(batch, 3, size, size, generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        module(x)
    for bn in bns:
        bn.momentum = 0.1
    return module.eval()


# The CNN suite (models/suite.py): the three above and seven more torchvision architectures
# (names and arguments that torchvision 0.26 and newer all have), plus the UNet.
CNN_ARCHS = (*TORCHVISION_ARCHS, "resnet50", "mobilenet_v2", "efficientnet_b0", "regnet_y_400mf",
             "shufflenet_v2_x1_0", "densenet121", "convnext_tiny", "unet")
CNN_SIZES = {"unet": 256}   # input side; the others 224
# A dry run's input side; VGG's adaptive pool to 7x7 exports only from a multiple of 7x7 features.
CNN_DRY_SIZES = {"vgg11": 224}


def cnn_module(arch: str, seed: int = 0):
    """The PyTorch module of CNN suite architecture `arch` (torchvision or "unet"), seeded,
    its BatchNorm statistics calibrated (calibrate_batchnorm), in eval mode."""
    m = unet_module(seed) if arch == "unet" else torchvision_module(arch, seed)
    return calibrate_batchnorm(m, seed)


def cnn_model(arch: str, size: int | None = None, seed: int = 0) -> onnx.ModelProto:
    """CNN suite architecture `arch` exported for input x [N, 3, size, size] (default 224, the
    UNet 256), output y, with the weights of cnn_module(arch, seed)."""
    torch = _import_torch()
    size = size or CNN_SIZES.get(arch, 224)
    return export_torch(cnn_module(arch, seed), (torch.randn(2, 3, size, size),), ["x"], ["y"])


CNN = {f"{a}.onnx": (lambda a=a: cnn_model(a)) for a in CNN_ARCHS}
TORCHVISION = {f"{a}.onnx": CNN[f"{a}.onnx"] for a in TORCHVISION_ARCHS}

GROUPS: dict[str, dict[str, Callable[[], onnx.ModelProto]]] = {
    "small": SMALL, "bench": BENCH, "torchvision": TORCHVISION, "cnn": CNN,
}
ALL = {**SMALL, **BENCH, **CNN}


def resolve(names: list[str] | None) -> list[tuple[str, bool]]:
    """File names to build for command-line names (groups, 'all', model names with or
    without .onnx), each with whether it was asked for by name. Default: the small ones."""
    if not names:
        return [(n, False) for n in SMALL]
    picked: dict[str, bool] = {}
    for name in names:
        if name == "all":
            picked.update({n: picked.get(n, False) for n in ALL})
        elif name in GROUPS:
            picked.update({n: picked.get(n, False) for n in GROUPS[name]})
        else:
            file = name if name.endswith(".onnx") else f"{name}.onnx"
            if file not in ALL:
                raise KeyError(f"unknown model {name!r}; choose from {', '.join(n[:-5] for n in ALL)}, "
                               f"or a group: all, {', '.join(GROUPS)}")
            picked[file] = True
    return list(picked.items())


def build(out: Path, names: list[str] | None = None, log=None) -> list[Path]:
    """Write the models to `out`. Torchvision models are skipped (with a note to `log`) when
    torchvision is missing, unless asked for by name (then TorchUnavailable is raised)."""
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for file, by_name in resolve(names):
        try:
            m = ALL[file]()
        except TorchUnavailable as e:
            if by_name:
                raise
            if log is not None:
                print(f"skipped {file}: {e}", file=log)
            continue
        path = out / file
        path.write_bytes(m.SerializeToString(deterministic=True))
        written.append(path)
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "build", help="output folder (default models/build)")
    ap.add_argument("names", nargs="*", help=f"models or groups to build (default: small = {', '.join(SMALL)}; "
                                              f"groups: all, {', '.join(GROUPS)})")
    args = ap.parse_args()
    try:
        paths = build(args.out, args.names, log=sys.stderr)
    except (KeyError, TorchUnavailable) as e:
        ap.exit(2, f"models.build: error: {e.args[0] if isinstance(e, KeyError) else e}\n")
    for p in paths:
        print(f"{p}  {p.stat().st_size} bytes")
    print(f"{len(paths)} models, {sum(p.stat().st_size for p in paths) / 1e6:.1f} MB in {args.out}")


if __name__ == "__main__":
    main()
