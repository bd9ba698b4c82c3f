"""The benchmark suite as data: real convolutional graphs nobody tuned onnxfuse on, each at
batch 1 and 16, and transformers at batch 1 and 8 (sequence 128), in fp32 and fp16.

    python -m models.suite                               # list the entries and their inputs
    python -m models.suite fetch models/build/pretrained # pre-fetch the pretrained ones, print the size

Entries:

- ``torchvision``: models.build.CNN_ARCHS' torchvision architectures (random weights, seed 0,
  BatchNorm statistics calibrated on random images) exported with torch.onnx at opset 17,
  dynamic batch, input x [N, 3, 224, 224];
- ``unet``: models.build's UNet (the same export), x [N, 3, 256, 256];
- ``pretrained``: real models shipped inside PyPI wheels (models/pretrained.py) at their
  natural input sizes;
- ``transformer`` (the group "transformer", not in the default CNN list): models/transformers.py's
  BERT-base (``bert_base``: input_ids and attention_mask [N, 128]), ViT-S/16 (``vit_s16``:
  pixel_values [N, 3, 224, 224]) and GPT-2 small (``gpt2_small``: input_ids [N, 128]), each
  exported by the TorchScript exporter (the plain name) and by the dynamo one (``<name>_dynamo``;
  skipped where onnxscript is missing), at batch 1 and 8; dry runs take the 2-layer d=64 twins
  at sequence 16. Each names the model type of ONNX Runtime's transformers optimizer
  (``ort_optimizer``) for benchmarks/compare.py's ``ort_tfopt`` and ``onnxfuse_tfopt`` variants
  (and their CUDA-graph twins ``ort_tfopt_graph`` and ``onnxfuse_tfopt_graph``).

An entry builds its model with ``model(dtype, dry)`` ("fp32" or "fp16"; fp16 made from the
fp32 one by models.fp16.to_fp16, fp16 inputs and outputs), gives its input shapes at a batch
with ``shapes(batch, dry)`` (dry: tiny shapes for a CPU dry run) and seeded inputs with
``feeds(shapes, dtype, seed)`` (images uniform in [0, 1)). ``torch_module()`` gives the PyTorch
module an exported entry came from, with the same weights (None for the pretrained ones).
`cases(batches, dtypes)` lists the (entry, batch, dtype) runs (batches None: each entry's own).
`entries(group)` lists a group: "cnn" (the default: the CNNs and the pretrained models),
"transformer", or "all"; `entry(name)` finds a name in any group.

Building costs: each ``model()`` call exports (or loads) again; fp16 converts the fp32 model,
so a caller wanting both should build fp32 once and pass it through models.fp16.to_fp16.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

from models import build as mb
from models import pretrained
from models import transformers as mt
from models.fp16 import DTYPES, convert

BATCHES = (1, 16)
TRANSFORMER_BATCHES = (1, 8)
GROUPS = ("cnn", "transformer", "all")
NP_DTYPES = {"fp32": np.float32, "fp16": np.float16}
DRY_BATCH = 2   # largest batch of a dry run


@dataclass(frozen=True)
class Entry:
    """One suite model: how to build it and feed it, and the PyTorch module it came from."""

    name: str
    kind: str                                     # torchvision | unet | pretrained | transformer
    inputs: dict[str, tuple[int, ...]]            # per-sample dims (no batch) at benchmark size
    dry_inputs: dict[str, tuple[int, ...]]        # the same, tiny, for a CPU dry run
    build: Callable[[bool], onnx.ModelProto]      # dry -> the fp32 model
    module: Callable[[bool], object] | None = None  # dry -> the torch module (fp32, eval, CPU), or None
    note: str = ""
    batches: tuple[int, ...] = BATCHES            # the batches `cases` takes by default
    # (shapes, numpy dtype, seed, dry) -> inputs; None: images uniform in [0, 1)
    make_feeds: Callable[[dict[str, tuple[int, ...]], type, int, bool], dict[str, np.ndarray]] | None = None
    # dry -> onnxruntime.transformers.optimizer.optimize_model's model_type, num_heads, hidden_size
    ort_optimizer: Callable[[bool], dict] | None = None

    def model(self, dtype: str = "fp32", dry: bool = False) -> onnx.ModelProto:
        """The model in `dtype` ("fp32" or "fp16"), built at dry-run size when `dry`."""
        return convert(self.build(dry), dtype)

    def shapes(self, batch: int, dry: bool = False) -> dict[str, tuple[int, ...]]:
        """Input dims at `batch` (a dry run caps the batch at DRY_BATCH and uses dry_inputs)."""
        if dry:
            return {k: (min(batch, DRY_BATCH), *d) for k, d in self.dry_inputs.items()}
        return {k: (batch, *d) for k, d in self.inputs.items()}

    def feeds(self, shapes: dict[str, tuple[int, ...]], dtype: str = "fp32", seed: int = 0,
              dry: bool = False) -> dict[str, np.ndarray]:
        """Seeded inputs: images uniform in [0, 1), in `dtype` (the fp16 ones are the fp32
        ones rounded, so fp32 and fp16 runs see the same pictures); a transformer's token ids
        and attention mask as models.transformers.feeds makes them (`dry`: its small vocabulary)."""
        if self.make_feeds is not None:
            return self.make_feeds(shapes, NP_DTYPES[dtype], seed, dry)
        rng = np.random.default_rng(seed)
        return {k: rng.random(s, dtype=np.float32).astype(NP_DTYPES[dtype], copy=False) for k, s in shapes.items()}

    def torch_module(self, dry: bool = False):
        """The PyTorch module the ONNX model (built at dry-run size when `dry`) was exported
        from (same weights), or None."""
        return None if self.module is None else self.module(dry)


@dataclass(frozen=True)
class Case:
    """One run of the suite: an entry at a batch size and a dtype."""

    entry: Entry
    batch: int
    dtype: str

    @property
    def name(self) -> str:
        return f"{self.entry.name}_b{self.batch}_{self.dtype}"

    def model(self, dry: bool = False) -> onnx.ModelProto:
        return self.entry.model(self.dtype, dry)

    def shapes(self, dry: bool = False) -> dict[str, tuple[int, ...]]:
        return self.entry.shapes(self.batch, dry)

    def feeds(self, dry: bool = False, seed: int = 0) -> dict[str, np.ndarray]:
        return self.entry.feeds(self.shapes(dry), self.dtype, seed, dry)


def _exported(arch: str) -> Entry:
    size, dry_size = mb.CNN_SIZES.get(arch, 224), mb.CNN_DRY_SIZES.get(arch, 64)

    def build(dry: bool) -> onnx.ModelProto:
        return mb.cnn_model(arch, dry_size if dry else size)

    kind = "unet" if arch == "unet" else "torchvision"
    origin = "UNet (models/build.py)" if arch == "unet" else "torchvision"
    note = f"{origin}, random weights (seed 0, BatchNorm calibrated), exported with torch.onnx"
    return Entry(arch, kind, {"x": (3, size, size)}, {"x": (3, dry_size, dry_size)}, build,
                 lambda _dry: mb.cnn_module(arch), note)


def _pretrained(name: str, dims: tuple[int, ...], dry_dims: tuple[int, ...]) -> Entry:
    spec = pretrained.PRETRAINED[name]
    (key,) = spec.shapes

    def build(dry: bool) -> onnx.ModelProto:
        return onnx.load(str(pretrained.fetch(name)))

    return Entry(name, "pretrained", {key: dims}, {key: dry_dims}, build, None,
                 f"{spec.description}; {spec.requirement}")


def _transformer(arch: str, exporter: str) -> Entry:
    def build(dry: bool) -> onnx.ModelProto:
        return mt.export(arch, exporter, small=dry)

    def make_feeds(shapes, dtype, seed: int, dry: bool) -> dict[str, np.ndarray]:
        return mt.feeds(arch, shapes, dtype, small=dry, seed=seed)

    def ort_optimizer(dry: bool) -> dict:
        c = mt.config(arch, dry)
        return {"model_type": mt.ORT_MODEL_TYPES[arch], "num_heads": c.heads, "hidden_size": c.dim}

    c = mt.config(arch)
    note = (f"models/transformers.py, {c.layers} layers, d {c.dim}, {c.heads} heads, random weights (seed 0), "
            f"exported by torch.onnx ({exporter}, opset {mt.OPSETS[exporter]})")
    return Entry(mt.model_name(arch, exporter), "transformer", mt.input_dims(arch), mt.input_dims(arch, small=True),
                 build, lambda dry: mt.module(arch, small=dry), note, TRANSFORMER_BATCHES, make_feeds, ort_optimizer)


def transformer_entries() -> list[Entry]:
    """The transformers: each architecture by the TorchScript exporter, then by dynamo."""
    return [_transformer(a, e) for e in mt.EXPORTERS for a in mt.CONFIGS]


def entries(group: str = "cnn") -> list[Entry]:
    """The suite's `group`, in order: "cnn" (the exported CNNs, then the pretrained models),
    "transformer", or "all" (both)."""
    if group not in GROUPS:
        raise ValueError(f"group {group!r}: choose from {', '.join(GROUPS)}")
    if group == "transformer":
        return transformer_entries()
    cnn = _cnn_entries()
    return cnn if group == "cnn" else cnn + transformer_entries()


def _cnn_entries() -> list[Entry]:
    return [*(_exported(a) for a in mb.CNN_ARCHS),
            _pretrained("yolov8n_320", (3, 320, 320), (3, 64, 64)),
            _pretrained("ppocr_det", (3, 640, 640), (3, 64, 96)),
            _pretrained("ppocr_rec", (3, 48, 320), (3, 48, 64)),
            _pretrained("ppocr_cls", (3, 48, 192), (3, 48, 64)),
            _pretrained("ppocr_v3_det", (3, 640, 640), (3, 64, 96)),
            _pretrained("doc_orientation", (3, 224, 224), (3, 224, 224))]


def entry(name: str) -> Entry:
    """The entry `name`, of any group."""
    for e in entries("all"):
        if e.name == name:
            return e
    raise KeyError(f"no suite entry {name!r}; choose from {', '.join(e.name for e in entries('all'))}")


def cases(batches: tuple[int, ...] | None = BATCHES, dtypes: tuple[str, ...] = DTYPES,
          names: list[str] | None = None, group: str = "cnn") -> list[Case]:
    """Every (entry, batch, dtype) run, entry by entry, of `group` or only the entries `names`
    (of any group); batches None: each entry's own (`Entry.batches`)."""
    for d in dtypes:
        if d not in DTYPES:
            raise ValueError(f"dtype {d!r}: choose from {', '.join(DTYPES)}")
    picked = entries(group) if names is None else [entry(n) for n in names]
    return [Case(e, b, d) for e in picked for b in (batches or e.batches) for d in dtypes]


def fetch_pretrained(folder: Path | None = None, log=sys.stdout) -> int:
    """Fetch the suite's pretrained models into `folder` (the pretrained cache by default), drop
    the downloaded wheels, print each file and the folder's total size; its byte count."""
    cache = folder or pretrained.cache_dir()
    total = 0
    for e in entries():
        if e.kind == "pretrained":
            path = pretrained.fetch(e.name, cache)
            total += path.stat().st_size
            print(f"{path}  {path.stat().st_size / 1e6:.1f} MB", file=log)
    wheels = cache / "wheels"
    for w in wheels.glob("*.whl"):
        w.unlink()
    if wheels.is_dir() and not any(wheels.iterdir()):
        wheels.rmdir()
    size = sum(p.stat().st_size for p in cache.rglob("*") if p.is_file())
    print(f"suite models {total / 1e6:.1f} MB; {cache} holds {size / 1e6:.1f} MB", file=log)
    return size


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd")
    sub.add_parser("list", help="list the entries (default)")
    f = sub.add_parser("fetch", help="fetch the pretrained entries into a folder (for the GPU machine)")
    f.add_argument("folder", type=Path, nargs="?", help="default $ONNXFUSE_MODELS or ~/.cache/onnxfuse/models")
    args = ap.parse_args(argv)
    if args.cmd == "fetch":
        try:
            fetch_pretrained(args.folder)
        except (pretrained.RegistryUnavailable, pretrained.ChecksumMismatch) as e:
            print(e, file=sys.stderr)
            return 1
        return 0
    for e in entries("all"):
        dims = ", ".join(f"{k} [N, {', '.join(map(str, d))}]" for k, d in e.inputs.items())
        print(f"{e.name:20} {e.kind:12} {dims:28} {e.note}")
    print(f"{len(entries())} CNN entries x batches {BATCHES} x {DTYPES} = {len(cases())} cases; "
          f"{len(entries('transformer'))} transformer entries x batches {TRANSFORMER_BATCHES} x {DTYPES} = "
          f"{len(cases(None, group='transformer'))} cases")
    return 0


if __name__ == "__main__":
    sys.exit(main())
