#!/usr/bin/env bash
# What one H200 session runs (device tool), after onnxruntime-gpu is installed in /tmp/site:
#   bash benchmarks/gpu_session.sh tests|sweep|tune|tune-long|...
# Results go to $OUT (the device tool's folder); the custom-op library comes from
# $ONNXFUSE_LIBRARY (built on the CPU machine) or is built there from carried headers.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
[ -f .devlib/libonnxfuse_ops.so ] && export ONNXFUSE_LIBRARY=$PWD/.devlib/libonnxfuse_ops.so
[ -d .devlib/ort-include ] && export ONNXFUSE_ORT_INCLUDE=$PWD/.devlib/ort-include
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# A folder carried to the device in one call is gone in the next: every call that runs models
# with the library must carry .devlib again (the eighth session lost a whole suite run to it).
case "${1:-tests}" in
  suite|suite-resume|suite-shapes|new-gpu-tests|all-tests|kernels|tests|final|nhwc|layout-models|compare|conv|nhwc-models|encoder|attention|hf-rotary|hf-dynamic|hf)
    if [ -z "${ONNXFUSE_LIBRARY:-}" ] && [ -z "${ONNXFUSE_ORT_INCLUDE:-}" ]; then
      echo "gpu_session.sh ${1}: no .devlib here (carry [\".devlib\"] in this call): stopping" >&2; exit 2
    fi ;;
esac
case "${1:-tests}" in
  tests)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/device.txt"
    python3 -c "import onnxruntime as o, torch, triton; print(o.__version__, torch.__version__, triton.__version__)" | tee -a "$OUT/device.txt"
    python3 -m pytest -m gpu tests/test_gpu_conv.py tests/test_conv_library.py -q -p no:cacheprovider -x \
      --junitxml="$OUT/gpu_conv_tests.xml" 2>&1 | tee "$OUT/gpu_conv_tests.log" | tail -40
    python3 -m pytest -m gpu tests/ --ignore=tests/test_gpu_conv.py --ignore=tests/test_conv_library.py -q \
      -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
    ;;
  tune)
    python3 benchmarks/tune_pointwise.py --json "$OUT/tune.json" --best "$OUT/best.txt" 2>&1 | tee "$OUT/tune.log"
    ;;
  tune-long)
    # the long chains only (the r = 64 knee), BLOCK 256..8192 x 2/4/8 warps, int32, masked: ~2 min
    timeout 300 python3 benchmarks/tune_pointwise.py --workloads "r=32,r=64,r=128" --blocks 256,512,1024,2048,4096,8192 \
      --warps 2,4,8 --int32 1 --even 0 --json "$OUT/tune_long.json" 2>&1 | tee "$OUT/tune_long.log"
    ;;
  compare)
    export ONNXFUSE_MODELS=$PWD/models/build/pretrained
    python3 benchmarks/compare.py --models "${2:-relu_maxpool,conv_relu,conv_relu_maxpool,vgg_stack,mlp_block,resnet18,yolov8n_320,ppocr_det}" \
      --iters 30 --json "$OUT/compare.json" --markdown "$OUT/compare.md" 2>&1 | grep -v "W:onnxruntime" | tee "$OUT/compare.log"
    ;;
  conv)
    # the conv issue's models and layers, plus the models the bench issue had not run yet
    export ONNXFUSE_MODELS=$PWD/models/build/pretrained
    python3 benchmarks/compare.py --models "${2:-relu_maxpool,conv_relu,conv_relu_maxpool,vgg_stack,resnet18,vgg11,mobilenet_v3_small,yolov8n_320_b1,yolov8n_320_b16,ppocr_det_640_b1,ppocr_det_640_b16}" \
      --iters 30 --json "$OUT/compare_${3:-conv}.json" --markdown "$OUT/compare_${3:-conv}.md" 2>&1 | grep -v "W:onnxruntime" | tee "$OUT/compare_${3:-conv}.log"
    ;;
  roofline)
    # issue 6 on the GPU: calibrate the device, then profile original and optimized models against it
    python3 -m onnxfuse.cli calibrate --out "$OUT/h200_profile.json" 2>&1 | tee "$OUT/calibrate.log"
    python3 -c "from models.build import mlp_block, conv_relu_maxpool; import onnx; onnx.save(mlp_block(), '/tmp/mlp.onnx'); onnx.save(conv_relu_maxpool(), '/tmp/crm.onnx')"
    for m in mlp crm; do
      python3 -m onnxfuse.cli optimize /tmp/$m.onnx /tmp/$m.opt.onnx --target sm_90 > /dev/null
      for v in $m $m.opt; do
        python3 -m onnxfuse.cli profile /tmp/$v.onnx --provider cuda --device "$OUT/h200_profile.json" --batch 32 \
          --json "$OUT/profile_$v.json" --plot "$OUT/profile_$v.png" 2>&1 | tee "$OUT/profile_$v.log"
      done
    done
    ;;
  layout)
    # the NHWC decision, part 1: the conv kernel in each layout and weight packing ([layer indices])
    timeout "${KERNEL_LIMIT:-480}" python3 benchmarks/conv_kernels.py --no-compile --json "$OUT/conv_kernels_layouts.json" \
      ${2:+--layers "$2"} > "$OUT/conv_kernels_layouts.log" 2>&1; tail -12 "$OUT/conv_kernels_layouts.log"
    ;;
  layout-models)
    # part 2: the layout GPU tests, then the models with and without the NHWC pass
    python3 -m pytest -m gpu tests/test_gpu_conv.py tests/test_conv_library.py -q -p no:cacheprovider -k "nhwc or layout" 2>&1 | tail -5
    python3 benchmarks/compare.py --models conv_relu,conv_relu_maxpool,vgg_stack,resnet18,vgg11 \
      --variants ort,ort_graph,onnxfuse,onnxfuse_graph --iters 30 \
      --json "$OUT/compare_layout.json" --markdown "$OUT/compare_layout.md" 2>&1 | grep -v "W:onnxruntime" | tail -12
    ;;
  nhwc-kernels)
    # boundary kernels of the NHWC pass (NCHW Y from channels-last X and the reverse), then
    # the batch-1 YOLO layers
    timeout 150 python3 benchmarks/conv_kernels.py --no-compile --layers 0,2 --configs 6 \
      --layouts nhwc-krsc,nhwc-krsc-nchw,nchw-rsck-nhwc,nchw-krsc --json "$OUT/conv_kernels_boundary.json" \
      > "$OUT/conv_kernels_boundary.log" 2>&1; tail -4 "$OUT/conv_kernels_boundary.log"
    timeout 120 python3 benchmarks/conv_kernels.py --no-compile --layers 7,8 --layouts nchw,nhwc-krsc \
      --json "$OUT/conv_kernels_small.json" > "$OUT/conv_kernels_small.log" 2>&1; tail -4 "$OUT/conv_kernels_small.log"
    ;;
  nhwc)
    # the NHWC pass with [K,R,S,C] weights: the conv GPU tests, then the conv models
    python3 -m pytest -m gpu tests/test_gpu_conv.py tests/test_conv_library.py -q -p no:cacheprovider \
      --junitxml="$OUT/gpu_conv_tests.xml" 2>&1 | tee "$OUT/gpu_conv_tests.log" | tail -6
    python3 benchmarks/compare.py --models "${2:-conv_relu,conv_relu_maxpool,vgg_stack,resnet18,vgg11}" \
      --variants "${3:-ort,ort_graph,onnxfuse,onnxfuse_graph,torch_compile}" --iters 30 \
      --json "$OUT/compare_nhwc.json" --markdown "$OUT/compare_nhwc.md" 2>&1 | grep -v "W:onnxruntime" | tail -12
    ;;
  final)
    # the GPU tests that touch convs, layouts and --tune, after the NHWC default
    timeout 200 python3 -m pytest -m gpu tests/test_gpu_conv.py tests/test_conv_library.py tests/test_tune.py \
      tests/test_layout.py -q -p no:cacheprovider -x 2>&1 | tee "$OUT/gpu_tests_final.log" | tail -4
    ;;
  nhwc-models)
    export ONNXFUSE_MODELS=$PWD/models/build/pretrained
    python3 benchmarks/compare.py --models "${2:-mobilenet_v3_small,yolov8n_320_b1,yolov8n_320_b16,ppocr_det_640_b1,ppocr_det_640_b16}" \
      --variants "${3:-ort,ort_graph,onnxfuse,onnxfuse_graph}" --iters 30 \
      --json "$OUT/compare_nhwc_models.json" --markdown "$OUT/compare_nhwc_models.md" 2>&1 | grep -v "W:onnxruntime" | tail -14
    ;;
  suite-prep)
    # the accuracy-and-speed issue, parts of one session: export the suite and convert it to
    # fp16 (model cache /tmp/suite-models), compile each case's kernels at its shapes and the
    # candidates its tuning will search (kernel cache: compare.py prepare), and once
    # onnxruntime is installed, run its transformers optimizer on each transformer (kept in the
    # model cache too). Run it once onnxruntime is installed: which nodes are matched depends
    # on ORT's own fusions (onnxfuse.ort_fusions), so without it the kernels compiled are not
    # all the timed run's. Needs torch, triton and onnx besides; with --models, one process per
    # model at once (exports, fp16 conversion and compiles use about one core each; the caches
    # are written by rename, so the processes share them).
    #   suite-prep LIMIT [compare.py arguments: --models ..., --dtypes ...]
    limit=${2:-400}; shift 2
    mkdir -p /tmp/pre && cp models/build/pretrained/*.onnx /tmp/pre/ 2>/dev/null
    models=""; rest=()
    while [ $# -gt 0 ]; do
      if [ "$1" = --models ] && [ $# -ge 2 ]; then models=$2; shift 2; else rest+=("$1"); shift; fi
    done
    if [ -z "$models" ]; then
      ONNXFUSE_MODELS=/tmp/pre timeout "$limit" python3 benchmarks/compare.py --suite --prepare \
        --model-cache /tmp/suite-models "${rest[@]}" 2>&1 | grep -v "W:onnxruntime" | tee -a "$OUT/suite_prep.log"
    else
      names=(${models//,/ })
      threads=$(( $(nproc) / ${#names[@]} )); [ "$threads" -ge 1 ] || threads=1
      for m in "${names[@]}"; do
        OMP_NUM_THREADS=$threads ONNXFUSE_MODELS=/tmp/pre timeout "$limit" python3 benchmarks/compare.py --suite \
          --prepare --model-cache /tmp/suite-models --models "$m" "${rest[@]}" > "/tmp/suite_prep_$m.log" 2>&1 &
      done
      wait
      for m in "${names[@]}"; do grep -v "W:onnxruntime" "/tmp/suite_prep_$m.log"; done | tee -a "$OUT/suite_prep.log"
    fi
    ;;
  suite|suite-resume)
    # the suite timed: ORT / ORT + graph / onnxfuse (tuned at the case's shapes) / onnxfuse +
    # graph, both errors and the gate; JSON after every case.
    #   suite TAG LIMIT [compare.py arguments: --models ..., --batches ..., --dtypes ..., --tune-budget S]
    # suite-resume: the same, cut into calls of one lease: the same command again goes on where
    # the last call stopped (rows every earlier call of this machine timed whole are skipped:
    # compare.py --skip-done over $RESUME_DIR), and each call ends with the table of every row
    # done so far (suite_TAG_merged.md).
    mode=$1; tag=${2:-a}; limit=${3:-580}; shift 3
    mkdir -p /tmp/pre && cp models/build/pretrained/*.onnx /tmp/pre/ 2>/dev/null
    earlier=()
    if [ "$mode" = suite-resume ]; then
      done_dir=${RESUME_DIR:-/tmp/suite-done}; mkdir -p "$done_dir"
      shopt -s nullglob; earlier=("$done_dir"/*.json); shopt -u nullglob
    fi
    # --stop-after: no row is started that rows like it say would not end before the limit (one
    # cut off by the timeout is lost: the forty-fourth session lost a GPT-2 row that way); 40 s
    # are left for compare.py's start and the merged table
    ONNXFUSE_MODELS=/tmp/pre timeout "$limit" python3 benchmarks/compare.py --suite --model-cache /tmp/suite-models \
      --iters 60 --warmup 5 --stop-after $(( limit > 80 ? limit - 40 : limit / 2 )) \
      --json "$OUT/suite_$tag.json" ${earlier[@]:+--skip-done "${earlier[@]}"} "$@" 2>&1 \
      | grep -v "W:onnxruntime" | tee "$OUT/suite_$tag.log" | grep -E "^\S|gate|error|Error|warning|clocks" | tail -60
    if [ "$mode" = suite-resume ]; then
      # numbered in call order: --from-json takes each row from the last file that has it
      [ -f "$OUT/suite_$tag.json" ] && cp "$OUT/suite_$tag.json" "$done_dir/$(printf %02d ${#earlier[@]})_suite_$tag.json"
      shopt -s nullglob; all=("$done_dir"/*.json); shopt -u nullglob
      [ ${#all[@]} -gt 0 ] && python3 benchmarks/compare.py --from-json "${all[@]}" \
        --markdown "$OUT/suite_${tag}_merged.md" | tail -30
    fi
    ;;
  floors)
    # issue 17's roofline bars beside the floors every kernel has: the residual + LayerNorm tiles
    # against torch's add of the same row tensors and an empty kernel, at BERT's batches and
    # beyond; cuBLAS's product alone against the datasheet peak the GEMM bar divides by
    timeout "${FLOORS_LIMIT:-300}" python3 benchmarks/rows_context.py --batches 8,1,32,128 --loads first \
      --json "$OUT/rows_context_floors.json" > "$OUT/rows_context_floors.log" 2>&1; grep -E "^f(16|32) " "$OUT/rows_context_floors.log"
    timeout 120 python3 benchmarks/gemm_roofline.py --ceiling --json "$OUT/gemm_ceiling.json" 2>&1 | tee "$OUT/gemm_ceiling.log"
    ;;
  suite-sharded)
    # the suite on every GPU of the machine at once (nvidia-h200-x4: 68 rows in about a quarter
    # of one GPU's time): one compare.py per GPU, each every N-th model (--shard K/N; a model's
    # rows stay in one process), its own CPU threads (nproc / N), the tuning and model caches
    # shared (tuning's cache merges what other processes wrote); then one table from their JSON.
    #   suite-sharded TAG LIMIT [compare.py arguments: --models ..., --batches ..., --dtypes ...]
    tag=${2:-all}; limit=${3:-580}; shift 3
    n=$(nvidia-smi -L | grep -c '^GPU')
    [ "$n" -ge 1 ] || { echo "suite-sharded: no GPU" >&2; exit 2; }
    mkdir -p /tmp/pre && cp models/build/pretrained/*.onnx /tmp/pre/ 2>/dev/null
    threads=$(( $(nproc) / n )); [ "$threads" -ge 1 ] || threads=1
    for k in $(seq 0 $((n - 1))); do
      CUDA_VISIBLE_DEVICES=$k OMP_NUM_THREADS=$threads ONNXFUSE_MODELS=/tmp/pre timeout "$limit" \
        python3 benchmarks/compare.py --suite --shard "$k/$n" --model-cache /tmp/suite-models --iters 30 --warmup 5 \
        --json "$OUT/suite_${tag}_$k.json" "$@" > "$OUT/suite_${tag}_$k.log" 2>&1 &
    done
    wait
    grep -h -E "gate|error|Error" "$OUT"/suite_"${tag}"_*.log | grep -v "W:onnxruntime" | tail -40
    python3 benchmarks/compare.py --table ort,ort_graph,onnxfuse,onnxfuse_graph --from-json "$OUT"/suite_"${tag}"_*.json \
      --markdown "$OUT/suite_$tag.md" | tail -8
    ;;
  new-gpu-tests)
    # what the seventh and eighth sessions built without a GPU, first on it: producer rounding
    # (bit-identical), NaN through every fused kernel (the grouped GEMM too), transcendental
    # tails through the CUDA kernels, tuning's accuracy step and replicated one-node timings
    # (test_tune's gpu cases), then the conv tests
    timeout "${2:-300}" python3 -m pytest -m gpu tests/test_rounding.py tests/test_nan.py tests/test_tails.py \
      tests/test_tune.py tests/test_gpu_conv.py -q -p no:cacheprovider -rf 2>&1 | tee "$OUT/gpu_tests_new.log" | tail -15
    ;;
  grouped)
    # grouped convs: the direct loop and the block-diagonal GEMM against cuDNN (LAYERS 16-25)
    timeout "${2:-200}" python3 benchmarks/conv_kernels.py --no-compile --layers 16,17,18,19,20,21,22,23,24,25 \
      --layouts nhwc-krsc --json "$OUT/conv_kernels_grouped.json" > "$OUT/conv_kernels_grouped.log" 2>&1
    grep -E "cuDNN .* direct" "$OUT/conv_kernels_grouped.log"
    ;;
  kernels)
    # where the GPU time goes: a suite model as suite-prep cached it, optimized with the defaults
    # (tuned) and with --no-tune (the heuristics' model), each through `onnxfuse profile
    # --provider cuda` (CUPTI through torch's profiler: every kernel's GPU time, attributed to
    # the ONNX Runtime node that launched it).   kernels NAME SHAPE   e.g. kernels efficientnet_b0_fp32 x=1,3,224,224
    src=/tmp/suite-models/$2.onnx; [ -f "$src" ] || src=/tmp/pre/${2%_fp32}.onnx
    python3 -m onnxfuse.cli optimize "$src" "/tmp/$2.opt.onnx" --shape "$3" --tune-budget 20 2>&1 | tail -4
    python3 -m onnxfuse.cli optimize "$src" "/tmp/$2.heur.onnx" --shape "$3" --no-tune 2>&1 | tail -1
    for v in "$src" "/tmp/$2.opt.onnx" "/tmp/$2.heur.onnx"; do
      python3 -m onnxfuse.cli profile "$v" --provider cuda --device h200 --shape "$3" --top 25 \
        --json "$OUT/profile_$(basename "$v" .onnx).json" 2>&1 | tee "$OUT/profile_$(basename "$v" .onnx).log" | head -45
    done
    ;;
  encoder)
    # issue 17's first measurement again: a 4-layer torch.nn.TransformerEncoder (d 768, 12 heads,
    # GELU FFN, opset 17, TorchScript exporter, seeded random weights), optimized at seq 128 for
    # each batch with the defaults (ORT's own fusions left to it) and with --no-leave-to-ort,
    # then ORT against both, with and without CUDA graphs, gated.   encoder [LIMIT]
    python3 - <<'PY'
import torch
torch.manual_seed(0)
layer = torch.nn.TransformerEncoderLayer(768, 12, 3072, dropout=0.0, activation="gelu", batch_first=True)
enc = torch.nn.TransformerEncoder(layer, 4, enable_nested_tensor=False).eval()
torch.onnx.export(enc, (torch.randn(1, 128, 768),), "/tmp/enc.onnx", opset_version=17, input_names=["x"],
                  output_names=["y"], dynamic_axes={"x": {0: "batch", 1: "seq"}}, dynamo=False)
PY
    for b in 1 8; do
      timeout "${2:-120}" python3 -m onnxfuse.cli optimize /tmp/enc.onnx /tmp/enc.opt.b$b.onnx --shape seq=128 --batch $b \
        --tune-budget 10 --json "$OUT/enc_opt_b$b.json" 2>&1 | tail -3
      timeout "${2:-120}" python3 -m onnxfuse.cli optimize /tmp/enc.onnx /tmp/enc.force.b$b.onnx --shape seq=128 --batch $b \
        --tune-budget 10 --no-leave-to-ort --json "$OUT/enc_force_b$b.json" 2>&1 | tail -3
      for g in "" --cuda-graph; do
        python3 -m onnxfuse.cli bench /tmp/enc.onnx /tmp/enc.opt.b$b.onnx /tmp/enc.force.b$b.onnx --provider cuda \
          --batch $b --shape seq=128 --iters 50 $g --json "$OUT/enc_bench_b$b${g:+_graph}.json" 2>&1 \
          | grep -v "W:onnxruntime" | tail -8
      done
    done
    ;;
  gemm-layouts)
    # cuBLAS's products by the weight's layout in ONNX Runtime (MatMul, Gemm, Gemm over K-major
    # weights: latency per product with and without CUDA graphs, device time, launches) and in
    # torch: the `kmajor-weights` decision and its batch-1 cost without graphs.
    #   gemm-layouts [LIMIT] [gemm_layouts.py arguments]
    limit=${2:-300}; shift $(( $# < 2 ? $# : 2 ))
    timeout "$limit" python3 benchmarks/gemm_layouts.py --json "$OUT/gemm_layouts.json" "$@" 2>&1 \
      | grep -v "W:onnxruntime" | tee "$OUT/gemm_layouts.log" | tail -40
    ;;
  gemm-ranks)
    # cuBLASLt's ranked algorithms for BERT-base's products + bias as GemmEpilogues against
    # ORT's MatMul and MatMul + Add (device µs, kernels, graph call, error against float64):
    # whether the products left to ORT would gain from a searched rank.
    #   gemm-ranks [LIMIT] [gemm_ranks.py arguments]
    limit=${2:-300}; shift $(( $# < 2 ? $# : 2 ))
    timeout "$limit" python3 benchmarks/gemm_ranks.py --json "$OUT/gemm_ranks.json" "$@" 2>&1 \
      | grep -v "W:onnxruntime" | tee "$OUT/gemm_ranks.log" | tail -60
    ;;
  suite-shapes)
    # the rows timed four ways in one call, the variant set (all six, or the three graph
    # variants) crossed with the runs per variant (60, 150); the tuning and models come from
    # the first pass's caches. Built to find what moved onnxfuse + graphs by 5-8% between two
    # calls of one lease (fortieth session); neither did (forty-first: 0.396-0.399 ms three
    # ways from the cache): the slower call had tuned in its own process, under the profiler (bundle-worker).
    #   suite-shapes LIMIT [compare.py arguments: --models ..., --batches ..., --dtypes ...]
    limit=${2:-580}; shift $(( $# < 2 ? $# : 2 ))
    all=ort,ort_graph,ort_tfopt,ort_tfopt_graph,onnxfuse,onnxfuse_graph; graphs=ort_graph,ort_tfopt_graph,onnxfuse_graph
    end=$(( $(date +%s) + limit ))
    for shape in "six60 $all 60" "three150 $graphs 150" "six150 $all 150" "three60 $graphs 60"; do
      set -- $shape "$@"; tag=$1 variants=$2 iters=$3; shift 3
      left=$(( end - $(date +%s) )); [ "$left" -gt 20 ] || break
      mkdir -p /tmp/pre && cp models/build/pretrained/*.onnx /tmp/pre/ 2>/dev/null
      ONNXFUSE_MODELS=/tmp/pre timeout "$left" python3 benchmarks/compare.py --suite --model-cache /tmp/suite-models \
        --warmup 5 --tune-budget 20 --variants "$variants" --iters "$iters" --json "$OUT/suite_shapes_$tag.json" "$@" 2>&1 \
        | grep -v "W:onnxruntime" > "$OUT/suite_shapes_$tag.log"
      grep -E "^\| |clocks" "$OUT/suite_shapes_$tag.log" | sed "s/^/$tag /" | tail -12
    done
    ;;
  attention-ncu)
    # Nsight Compute on FusedAttention's kernel and cuDNN's (through torch) at the same inputs:
    # where the batch-8 gap comes from (stall reasons, occupancy, L2 hits). torch and triton
    # only, so it fits the first install call. attention-ncu [LIMIT] [attention_tiles.py arguments]
    #   e.g. attention-ncu 300 --workloads vit,bert --batches 8 --tiles 32x128x4x2,128x128x8x1
    limit=${2:-300}; shift $(( $# < 2 ? $# : 2 ))
    ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
    timeout -s INT "$limit" "$ncu" --set full --csv --page details -k 'regex:onnxfuse_attention_tiles|sdpa|fmha' \
      python3 benchmarks/attention_tiles.py --once "$@" > "$OUT/ncu_attention.csv" 2> "$OUT/ncu_attention.log"
    echo "ncu exit $?; $(wc -l < "$OUT/ncu_attention.csv") CSV lines"; tail -5 "$OUT/ncu_attention.log"
    ;;
  attention)
    # FusedAttention at BERT-base, GPT-2 and ViT-S/16 shapes against its roofline bound, ORT's
    # unfused nodes, ORT's MultiHeadAttention and torch's SDPA, every tile timed; JSON after each
    # case, each case's log beside it.   attention [LIMIT] [TAG] [attention_roofline.py arguments]
    #   e.g. attention 560 fp16 --dtypes fp16
    limit=${2:-560}; tag=${3:+_$3}; shift $(( $# < 3 ? $# : 3 ))
    timeout -s INT "$limit" python3 benchmarks/attention_roofline.py --json "$OUT/attention_roofline$tag.json" "$@" \
      2>&1 | grep -v "W:onnxruntime" | tee "$OUT/attention_roofline$tag.log"
    ;;
  hf-rotary)
    # the rotary work of the twenty-sixth to twenty-eighth sessions, first on a GPU: every interpreter
    # case under Triton on the GPU (rotate-half-*, transposed-*, partial-*, rotate-pairs-* among them),
    # then Hugging Face decoders at full size against ORT, ORT + graphs and the tf-optimizer, errors beside:
    # LLaMA and Qwen2 (rotate_half, Q and K read through their Transposes), Phi, StableLM and GPT-NeoX
    # (partial), GPT-J (interleaved and partial); JSON after each case.   hf-rotary [LIMIT] [BATCH] [DTYPE] [ARCHS]
    limit=${2:-560}; b=${3:-8}; dt=${4:-fp16}
    timeout -s INT 150 python3 -m pytest -m gpu tests/test_codegen.py -q -p no:cacheprovider -rf \
      -k "gpu_kernels_match_reference" 2>&1 | tee "$OUT/gpu_tests_rotary.log" | tail -4
    timeout -s INT "$limit" python3 benchmarks/hf_attention.py --archs "${5:-llama,qwen2,phi,stablelm,gpt_neox,gptj}" \
      --attn sdpa --batch "$b" --dtype "$dt" --cuda-graph --tf-optimizer --tune-budget 3 \
      --json "$OUT/hf_rotary_b${b}_${dt}.json" 2>&1 | grep -v "W:onnxruntime" | tee "$OUT/hf_rotary_b${b}_${dt}.log" \
      | grep "^|" | tee "$OUT/hf_rotary_b${b}_${dt}.md"
    ;;
  hf-dynamic)
    # the twenty-ninth session's dynamic exports (batch and sequence), optimized without --shape as a
    # deployed model is, against ORT and the tf-optimizer (no CUDA graphs: the models stay dynamic),
    # at the export's shape and another; each exporter half the limit.   hf-dynamic [LIMIT] [BATCH] [DTYPE] [ARCHS]
    limit=${2:-500}; b=${3:-8}; dt=${4:-fp16}
    for e in torchscript dynamo; do
      timeout -s INT $((limit / 2)) python3 benchmarks/hf_attention.py --archs "${5:-bert,llama,gpt2,vit}" --attn sdpa \
        --batch "$b" --dtype "$dt" --dynamic --exporter "$e" --tf-optimizer --tune-budget 3 \
        --json "$OUT/hf_dynamic_${e}_b${b}_${dt}.json" 2>&1 | grep -v "W:onnxruntime" | tee "$OUT/hf_dynamic_${e}_b${b}_${dt}.log" \
        | grep "^|" | tee "$OUT/hf_dynamic_${e}_b${b}_${dt}.md"
    done
    ;;
  hf)
    # Hugging Face families at full size, static shapes (--shape: CUDA graphs) against ORT, ORT + graphs
    # and the tf-optimizer, errors beside; default: the thirtieth session's attentions over merged heads
    # (BLOOM's ALiBi, DeBERTa-v3's disentangled attention). The whole log beside the table: each case's
    # stages and their seconds (a case cut off by LIMIT says where its time went).   hf [LIMIT] [BATCH] [DTYPE] [ARCHS]
    limit=${2:-400}; b=${3:-8}; dt=${4:-fp16}
    timeout -s INT "$limit" python3 benchmarks/hf_attention.py --archs "${5:-bloom,deberta_v2}" \
      --attn sdpa --batch "$b" --dtype "$dt" --cuda-graph --tf-optimizer --tune-budget 3 \
      --json "$OUT/hf_b${b}_${dt}.json" 2>&1 | grep -v "W:onnxruntime" | tee "$OUT/hf_b${b}_${dt}.log" \
      | grep "^|" | tee "$OUT/hf_b${b}_${dt}.md"
    ;;
  all-tests)
    # every GPU-marked test (pointwise, conv, pools, layouts, --tune, reliability)
    timeout "${2:-330}" python3 -m pytest -m gpu tests -q -p no:cacheprovider -rf --durations=30 2>&1 | tee "$OUT/gpu_tests_all.log" | tail -15
    ;;
  gpu-tests-a|gpu-tests-b)
    # every GPU-marked test in two calls of under 600 s each (about 290 s and 390 s on the H200,
    # eleventh session); a: the row kernels first and alone (their first test compiles every
    # case: 37 s), then the library, NaN, rounding, conv-library and attention tests; b: the rest
    P="python3 -m pytest -m gpu -q -p no:cacheprovider -rf --tb=short --durations=12"
    if [ "$1" = gpu-tests-a ]; then
      timeout -s INT 220 $P tests/test_rows_gpu.py 2>&1 | tee "$OUT/gpu_tests_a1.log" | grep -v '^\.*\s*\[' | tail -20
      timeout -s INT "${2:-330}" $P tests/test_library.py tests/test_nan.py tests/test_rounding.py tests/test_gpu.py \
        tests/test_conv_library.py tests/test_rows_codegen.py tests/test_attention_gpu.py tests/test_attention_codegen.py \
        2>&1 | tee "$OUT/gpu_tests_a2.log" | grep -v '^\.*\s*\[' | tail -30
    else
      timeout -s INT "${2:-560}" $P tests/test_gpu_conv.py tests/test_gpu_reliability.py tests/test_gemm_gpu.py \
        tests/test_rows_groupnorm_gpu.py tests/test_conv_small_m.py tests/test_bench.py tests/test_codegen.py \
        tests/test_tails.py tests/test_gemm_codegen.py tests/test_rows_groupnorm_codegen.py tests/test_squeeze_gpu.py tests/test_bundle_gpu.py tests/test_tf32probe.py 2>&1 \
        | tee "$OUT/gpu_tests_b.log" | grep -v '^\.*\s*\[' | tail -30
    fi
    ;;
  verify)
    # what the fourth session left unmeasured (benchmarks/results/history.md, fourth session, "After the last GPU run"): every
    # GPU test (the pool variants for C or W % 16 == 0 included), the pool kernels, then the
    # conv models; the pretrained ones need models/build carried: nhwc-models yolov8n_320_b1,...
    bash "$0" all-tests 400
    timeout 120 python3 benchmarks/conv_kernels.py --pool-only --no-compile --json "$OUT/relu_maxpool_tiles.json" \
      2>&1 | tail -4
    python3 benchmarks/compare.py --models relu_maxpool,conv_relu,conv_relu_maxpool,vgg_stack,resnet18,vgg11,mobilenet_v3_small \
      --variants ort,ort_nhwc,ort_graph,onnxfuse,onnxfuse_graph,torch_compile --iters 30 \
      --json "$OUT/compare_verify.json" --markdown "$OUT/compare_verify.md" 2>&1 | grep -v "W:onnxruntime" | tail -12
    ;;
  split)
    # split K: the YOLOv8n b1 layers alone, then the pretrained models with the split-K
    # variant (as shipped) and without it (ONNXFUSE_CONV_CONFIG=split=0), in one session
    timeout 200 python3 benchmarks/split_k.py --json "$OUT/split_k.json" 2>&1 | grep -v "W:onnxruntime" | tail -12
    export ONNXFUSE_MODELS=$PWD/models/build/pretrained
    M=yolov8n_320_b1,yolov8n_320_b16,ppocr_det_640_b1,ppocr_det_640_b16
    python3 benchmarks/compare.py --models $M --variants ort,ort_graph,onnxfuse,onnxfuse_graph --iters 50 \
      --json "$OUT/compare_split.json" --markdown "$OUT/compare_split.md" 2>&1 | grep -v "W:onnxruntime" | tail -7
    ONNXFUSE_CONV_CONFIG=split=0 python3 benchmarks/compare.py --models $M --variants ort_graph,onnxfuse,onnxfuse_graph \
      --iters 50 --json "$OUT/compare_nosplit.json" --markdown "$OUT/compare_nosplit.md" 2>&1 | grep -v "W:onnxruntime" | tail -7
    ;;
  precision)
    # conv precision: every shipped conv kernel at tf32 (rounded), tf32 truncated, tf32x3 and
    # ieee beside cuDNN TF32 on/off, error against float64 and time ([layer indices]); needs
    # torch and triton only. Expected: 3-5 min.
    timeout 580 python3 benchmarks/conv_precision.py --json "$OUT/conv_precision.json" ${2:+--layers "$2"} \
      > "$OUT/conv_precision.log" 2>&1; tail -140 "$OUT/conv_precision.log"
    ;;
  cache-save)
    # the tuning cache and the compiled kernels (~/.cache/onnxfuse/{tune,kernels}) into $OUT, so
    # that a later call on a fresh machine starts warm (`cache-load`): one archive where it stays
    # under the tool's 16 MiB per file; else the tuning cache alone in onnxfuse_cache.tgz and the
    # kernels in parts onnxfuse_kernels.tgz.0, .1, ... (at most CACHE_MAX_PARTS, else left out)
    root=${ONNXFUSE_CACHE:-$HOME/.cache/onnxfuse}; part=${CACHE_PART_BYTES:-15000000}
    parts=$(cd "$root" 2>/dev/null && ls -d tune kernels 2>/dev/null)
    [ -n "$parts" ] || { echo "cache-save: nothing under $root"; exit 0; }
    tar czf /tmp/onnxfuse_cache.tgz -C "$root" $parts
    if [ "$(stat -c %s /tmp/onnxfuse_cache.tgz)" -gt "$part" ]; then
      tar czf /tmp/onnxfuse_cache.tgz -C "$root" tune 2>/dev/null
      rm -f /tmp/onnxfuse_kernels.tgz.*
      tar czf - -C "$root" kernels | split -b "$part" -d -a 2 - /tmp/onnxfuse_kernels.tgz.
      n=$(ls /tmp/onnxfuse_kernels.tgz.* | wc -l)
      if [ "$n" -le "${CACHE_MAX_PARTS:-5}" ]; then
        mv /tmp/onnxfuse_kernels.tgz.* "$OUT/" && echo "cache-save: kernels in $n parts"
      else
        rm -f /tmp/onnxfuse_kernels.tgz.*; echo "cache-save: kernels left out ($n parts)"
      fi
    fi
    mv /tmp/onnxfuse_cache.tgz "$OUT/" && ls -la "$OUT"/onnxfuse_*
    ;;
  cache-load)
    # cache-load ARCHIVE: what cache-save wrote, unpacked under ~/.cache/onnxfuse, with the
    # kernels' parts beside it (onnxfuse_kernels.tgz.NN) where there are any. A suite run after
    # it re-measures nothing it remembers: its tune records say so (measured, cache_hits).
    # ARCHIVE may be a kernel cache filled on the CPU machine instead, carried in .devcache/
    # (xz: about 1/30 of its size, the PTX repeats; gzip only 1/4), so that suite-prep's and the
    # suite's compiles are hits instead of device time. Fill it with the device's triton and
    # onnxruntime (which nodes are matched depends on ORT's fusions) for its arch:
    #   PYTHONPATH=<onnxruntime 1.31.1>:$PWD ONNXFUSE_CACHE=$PWD/.devcache/kernels python3 benchmarks/compare.py \
    #     --suite --prepare --target sm_90 --models ... --batches 1,8 --dtypes fp32,fp16
    #   tar cJf .devcache/kernels.tar.xz -C .devcache kernels
    # A call carries 64 MiB with the working tree: 442 MB of kernels were 30 MB of xz, carried
    # in a call of their own as two archives (kernels/[0-7]? and kernels/[89a-f]?), one
    # cache-load each (forty-fifth session). There the dynamo exports' kernels mostly missed
    # (their search candidates hit): likely because this machine exported them with torch
    # 2.13 and the device with 2.11; fill it with the device's torch too.
    root=${ONNXFUSE_CACHE:-$HOME/.cache/onnxfuse}; archive=${2:?cache-load ARCHIVE}
    mkdir -p "$root" && tar xf "$archive" -C "$root" || exit 1
    kparts=$(ls "$(dirname "$archive")"/onnxfuse_kernels.tgz.[0-9][0-9] 2>/dev/null)
    [ -z "$kparts" ] || cat $kparts | tar xzf - -C "$root" || exit 1
    du -sh "$root"/* 2>/dev/null
    ;;
  sweep)
    [ -f "$OUT/best.txt" ] && export ONNXFUSE_POINTWISE_CONFIG=$(cat "$OUT/best.txt")
    echo "ONNXFUSE_POINTWISE_CONFIG=${ONNXFUSE_POINTWISE_CONFIG:-default}"
    python3 benchmarks/intensity_sweep.py --json "$OUT/intensity_sweep.json" --png "$OUT/intensity_sweep.png" 2>&1 | tee "$OUT/intensity_sweep.log"
    ;;
esac
# The device tool brings back at most 8 files from $OUT (the fourteenth session lost a suite's
# JSON to it): past 7, every file this run left there that is not already packed goes into one
# archive, bundle_<mode>_<pid>.tgz, and is removed; earlier runs' bundles stay beside it.
if [ "$(find "$OUT" -type f | wc -l)" -gt 7 ]; then
  b="bundle_${1:-tests}_$$.tgz"
  if (cd "$OUT" && find . -type f ! -name 'bundle_*.tgz' -print0 | tar czf "/tmp/$b" --null -T -); then
    (cd "$OUT" && find . -type f ! -name 'bundle_*.tgz' -delete) && mv "/tmp/$b" "$OUT/$b"
  fi
fi
