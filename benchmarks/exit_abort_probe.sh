#!/usr/bin/env bash
# Which library aborts attention_roofline.py's case processes at exit ("double free or corruption
# (out)", "(!prev)", "free(): invalid size"; SIGABRT after the accuracy step's line, 5 of 12 cases
# on the H200 with onnxruntime-gpu 1.31.1 and torch 2.11 cu130). On the CPU machine the onnxfuse
# library ran clean under AddressSanitizer and valgrind, its CUDA launchers included (run against
# a fake libcuda); what remains in that process: torch's profiler (CUPTI, kineto) started 20+
# times, ORT's CUDA EP (and its profiler), torch's SDPA, Triton. Each mode runs one case process
# directly (no parent) REPEAT times and prints its exit codes (134: SIGABRT).
# Nineteenth session: `onnxfuse optimize` with tuning aborts the same way (3 of 5 runs of a BERT-style
# encoder); Python's atexit handlers and gc.collect() ran clean before os._exit, so the abort is in the
# native teardown; the console script and the GPU benchmarks now end with onnxfuse.cli.end_process.
#
#   bash benchmarks/exit_abort_probe.sh MODE [CASE] [REPEAT]       CASE default bert,fp16,8
#   MODE: gdb        the case under gdb: every thread's backtrace at the abort (which library's
#                    free, in which thread, and whether under exit()'s handlers)  -> $OUT/gdb.txt
#         rate       as the benchmark runs it: how often it aborts
#         nocupti    torch imported and SDPA run, but torch's profiler never started (onnxfuse's
#                    _run_under_cupti replaced by plain runs: host times)
#         notorch    torch not importable (and --no-torch): no CUPTI, no torch CUDA context
#         nolib      no onnxfuse library in the process: ORT's CUDA MultiHeadAttention and torch's
#                    profiler, sessions opened and profiled as the case does, then exit
#         mcheck     glibc's malloc checks (libc_malloc_debug, MALLOC_CHECK_=3, no tcache) under
#                    gdb: the backtrace nearer the corruption
# Environment: TILES (default candidates,extra; e.g. 64x64x4x2 for a short run), OUT; PROVIDER=cpu
# TARGET=sm_90 rehearses the modes but nolib on the CPU.
set -uo pipefail
mode=${1:?mode}; case_=${2:-bert,fp16,8}; repeat=${3:-3}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=${PYTHONPATH:-/tmp/site:$PWD} PYTHONUNBUFFERED=1
[ -f .devlib/libonnxfuse_ops.so ] && export ONNXFUSE_LIBRARY=$PWD/.devlib/libonnxfuse_ops.so
[ -d .devlib/ort-include ] && export ONNXFUSE_ORT_INCLUDE=$PWD/.devlib/ort-include
PY=$(python3 -c "import sys; print(sys.executable)")
TMP=$(mktemp -d /tmp/exit_probe.XXXX)
CASE_ARGS=(-u benchmarks/attention_roofline.py --case "$case_" --case-json "$TMP/row.json" --tmp "$TMP"
           --tiles "${TILES:-candidates,extra}" --provider "${PROVIDER:-cuda}" --target "${TARGET:-auto}")
GDB=(gdb -q -batch -ex "set pagination off" -ex "handle SIGPIPE nostop noprint")
GDB_RUN=(-ex run -ex "info threads" -ex "thread apply all bt 30" -ex "info sharedlibrary")

repeat_case() {  # $1: label; the rest: environment assignments and extra arguments via EXTRA
  local label=$1; shift
  for i in $(seq "$repeat"); do
    env "$@" "$PY" "${CASE_ARGS[@]}" ${EXTRA:-} > "$OUT/$label.$i.log" 2>&1
    echo "$label run $i: exit $? | $(tail -n 2 "$OUT/$label.$i.log" | tr '\n' ' ' | cut -c1-200)"
  done
}

case "$mode" in
  gdb)
    "${GDB[@]}" "${GDB_RUN[@]}" --args "$PY" "${CASE_ARGS[@]}" > "$OUT/gdb.txt" 2>&1
    grep -n -m5 "SIGABRT\|double free\|free()" "$OUT/gdb.txt"
    # the aborting thread's frames, and which objects they are in
    awk '/received signal SIGABRT/{p=1} p' "$OUT/gdb.txt" | sed -n 1,60p ;;
  rate) repeat_case rate PYTHONPATH="$PYTHONPATH" ;;
  nocupti)
    mkdir -p "$TMP/nocupti"
    cat > "$TMP/nocupti/sitecustomize.py" <<'EOF'
import onnxfuse.profile as _p


def _plain(torch, run, iters, tmp):  # no torch profiler (CUPTI): the runs only
    for _ in range(iters):
        run()
    return None


_p._run_under_cupti = _plain
EOF
    repeat_case nocupti PYTHONPATH="$TMP/nocupti:$PYTHONPATH" ;;
  notorch)
    mkdir -p "$TMP/notorch/torch"
    echo 'raise ImportError("torch blocked by exit_abort_probe.sh")' > "$TMP/notorch/torch/__init__.py"
    EXTRA=--no-torch repeat_case notorch PYTHONPATH="$TMP/notorch:$PYTHONPATH" ;;
  nolib)
    cat > "$TMP/nolib.py" <<'EOF'
import sys, tempfile
from pathlib import Path

import onnxruntime as ort
import torch

from benchmarks import attention_roofline as ar
from onnxfuse.profile import _run_under_cupti

name, dtype, batch = sys.argv[1].split(",")
batch = int(batch)
feeds = ar.make_feeds(name, dtype, batch)
tmp = Path(tempfile.mkdtemp())
for i in range(12):  # about as many profiled sessions as one case opens
    for form in ar.MHA_FORMS[ar.WORKLOADS[name].mask]:
        so = ort.SessionOptions()
        so.enable_profiling, so.profile_file_prefix, so.log_severity_level = True, str(tmp / "p"), 3
        sess = ort.InferenceSession(ar.mha_model(name, dtype, batch, form).SerializeToString(), so,
                                    providers=[("CUDAExecutionProvider", {"device_id": "0"}), "CPUExecutionProvider"])
        f = ar.mha_feeds(name, feeds, form)
        sess.run(None, f)
        _run_under_cupti(torch, lambda: sess.run(None, f), 50, tmp)
        sess.end_profiling()
        del sess
print("onnxfuse library in the process:", any("onnxfuse" in line for line in open("/proc/self/maps")))
print("nolib: done", flush=True)
EOF
    for i in $(seq "$repeat"); do
      "$PY" "$TMP/nolib.py" "$case_" > "$OUT/nolib.$i.log" 2>&1
      echo "nolib run $i: exit $? | $(tail -n 2 "$OUT/nolib.$i.log" | tr '\n' ' ' | cut -c1-200)"
    done ;;
  mcheck)
    dbg=$(ls /lib/x86_64-linux-gnu/libc_malloc_debug.so.0 /usr/lib64/libc_malloc_debug.so.0 2>/dev/null | head -1)
    "${GDB[@]}" -ex "set exec-wrapper env LD_PRELOAD=$dbg MALLOC_CHECK_=3 GLIBC_TUNABLES=glibc.malloc.tcache_count=0" \
      "${GDB_RUN[@]}" --args "$PY" "${CASE_ARGS[@]}" > "$OUT/gdb_mcheck.txt" 2>&1
    awk '/received signal/{p=1} p' "$OUT/gdb_mcheck.txt" | sed -n 1,60p ;;
  *) echo "unknown mode $mode" >&2; exit 2 ;;
esac
