#!/usr/bin/env bash
# Prepares, on the CPU machine, what a GPU session carries besides onnxruntime-gpu (which
# ../shared/device/prepare.sh splits into .ort/): run from the project's root after it.
#   .devlib/libonnxfuse_ops.so   the custom-op library, built here (python -m onnxfuse.build)
#   .whl/                         onnxconverter-common (the suite's fp16 models) beside onnx-graphsurgeon
#   .devpre/, .devpre2/, ...      the suite's pretrained models (models/pretrained.py), in folders of at
#                                 most PRE_MB (default 12) MB: a call carries one or two of them
# All are listed in .git/info/exclude. Then, on the device (benchmarks/gpu_session.sh's header):
#   calls 1-4: the .ort parts; call 5 carries [".ort/p4", ".ort/install.sh", ".whl", ".devlib"] (the
#   last part is 49 MiB of the 64); later calls carry [".devlib", ".devpre", ".devpre2", ...] (about 37 MB
#   in all) and run  mkdir -p /tmp/pre && cp .devpre*/*.onnx /tmp/pre/  before `gpu_session.sh suite ...`
#   (which reads the pretrained models from /tmp/pre).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
for d in /.devlib/ /.devpre*/ /.devcache/; do grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
mkdir -p .devlib .whl
lib=$(python3 -m onnxfuse.build 2>/dev/null | tail -1)
[ -f "$lib" ] || { echo "device_prep: the library did not build (python3 -m onnxfuse.build)" >&2; exit 1; }
cp "$lib" .devlib/libonnxfuse_ops.so
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl onnxconverter-common==1.16.0
cache=$(python3 -c "from models import pretrained; print(pretrained.cache_dir())")
python3 -m models.pretrained > /dev/null
rm -rf .devpre .devpre[0-9]*
limit=$(( ${PRE_MB:-12} * 1000000 )); k=1; used=0; dir=.devpre
mkdir -p "$dir"
for name in $(python3 -c "from models import suite; print(' '.join(e.name for e in suite.entries() if e.kind == 'pretrained'))"); do
  f="$cache/$name.onnx"; size=$(stat -c %s "$f")
  if [ "$used" -gt 0 ] && [ $(( used + size )) -gt "$limit" ]; then
    k=$((k + 1)); dir=.devpre$k; mkdir -p "$dir"; used=0
  fi
  cp "$f" "$dir/"; used=$((used + size))
done
du -sh .devlib .whl .devpre*
