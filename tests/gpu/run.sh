#!/usr/bin/env bash
# The GPU check of the CUDA kernels, on a fresh CUDA machine with only this source tree and a CUDA build of torch:
# environment, JIT build of csrc/cuda (timed), the CPU-side arithmetic tests, the GPU kernel tests, the GPU model
# tests, the benchmark, Nsight Compute profiles of the kernels where ncu is installed. Every stage has a time
# limit and prints PASS / FAIL; a failed stage does not stop the others. The CPU op library is not built here
# (HF_W4_NO_EXT=1): the pure-PyTorch reference is the oracle. Output also goes to $OUT/gpu.log when OUT is set. Exit
# status 0 only if every stage passed.
#   bash tests/gpu/run.sh
# A kernel change is judged against a baseline benchmarked in the same run: HF_W4_GPU_BASELINE=DIR names another
# source tree (e.g. `git archive REV hf_w4 csrc setup.py setup.cfg | tar -x -C DIR`), whose library is built apart
# and timed by this tree's benchmark, then the two are compared cell by cell. Several trees, oldest first
# (HF_W4_GPU_BASELINE="DIR1 DIR2 ..."), say which step of a series made the difference: all build side by side, the
# first is benchmarked in full and the others with --quick, and each is compared with the next (the last with this
# tree) as well as the first with this tree. HF_W4_GPU_STAGES="jit-build gpu-wgmma ..."
# runs only the stages named (and the environment's), e.g. to recheck one change within a short GPU lease.
set -u
cd "$(dirname "$0")/../.." || exit 2
ROOT=$(pwd)
export PYTHONUNBUFFERED=1 HF_W4_NO_EXT=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export MAX_JOBS=${MAX_JOBS:-16}
export HF_W4_CUDA_BUILD_DIR=${HF_W4_CUDA_BUILD_DIR:-/tmp/hf_w4_cuda_build}
if [ -n "${OUT:-}" ]; then
  mkdir -p "$OUT"
  exec > >(tee -a "$OUT/gpu.log") 2>&1
fi

failed=()
selected() {  # selected NAME: whether stage NAME runs (HF_W4_GPU_STAGES)
  [ -z "${HF_W4_GPU_STAGES:-}" ] || [ "$1" = environment ] || [[ " $HF_W4_GPU_STAGES " == *" $1 "* ]]
}
stage() {  # stage NAME LIMIT_S COMMAND...
  local name=$1 limit=$2 t0 rc
  shift 2
  if ! selected "$name"; then
    echo; echo "=== $name: skipped (not in HF_W4_GPU_STAGES)"
    return
  fi
  echo
  echo "=== $name (limit ${limit}s): $*"
  t0=$(date +%s)
  timeout -k 10 "$limit" "$@"
  rc=$?
  if [ "$rc" -eq 0 ]; then
    echo "=== PASS $name ($(( $(date +%s) - t0 ))s)"
  else
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && rc="$rc (time limit)"
    echo "=== FAIL $name: exit $rc ($(( $(date +%s) - t0 ))s)"
    failed+=("$name")
  fi
}

T0=$(date +%s)
stage environment 20 bash -c 'nvidia-smi -L; nvcc --version | tail -n 2; gcc --version | head -n 1;
  python -c "import sys, torch, transformers; print(\"python\", sys.version.split()[0], \"torch\", torch.__version__,
  \"cuda\", torch.version.cuda, \"transformers\", transformers.__version__); print(torch.cuda.get_device_name(0),
  torch.cuda.get_device_capability(0))"'
# JIT build and load of csrc/cuda from the tree on PYTHONPATH (this one, or the baseline's), timed
JIT_LOAD='
import time
from hf_w4 import _ext
t = time.time()
ok = _ext.load_cuda()
print(f"JIT build + load of csrc/cuda: {time.time() - t:.1f}s in {_ext.cuda_build_dir()}:", "ok" if ok else _ext.cuda_load_error())
from hf_w4.kernels.cuda_w4a16 import CudaW4A16Kernel
print("cuda_w4a16.is_supported():", CudaW4A16Kernel.is_supported())
raise SystemExit(0 if ok else 1)'
stage jit-build 150 python -c "$JIT_LOAD"
# The baselines' libraries (HF_W4_GPU_BASELINE) build from here, in the background and side by side, on the CPU cores
# the tests leave idle, instead of adding their minute or two of compiling each to the run; their benchmarks wait
BASES=() BASE_BUILDS=()
base_env() {  # base_env I: the environment that runs a command on baseline I (its tree and its own build folder)
  BASE_ENV=(env PYTHONPATH="${BASES[$1]}${PYTHONPATH#"$ROOT"}" HF_W4_CUDA_BUILD_DIR=/tmp/hf_w4_cuda_baseline$1)
}
for dir in ${HF_W4_GPU_BASELINE:-}; do
  [ -d "$dir/hf_w4" ] || { echo "HF_W4_GPU_BASELINE: $dir is not a source tree (no hf_w4 folder)"; exit 2; }
  BASES+=("$(cd "$dir" && pwd)")
done
if selected baseline-benchmark; then
  for i in "${!BASES[@]}"; do
    base_env "$i"
    "${BASE_ENV[@]}" timeout -k 10 400 python -c "$JIT_LOAD" > "/tmp/hf_w4_baseline_build$i.log" 2>&1 &
    BASE_BUILDS+=($!)
  done
fi
stage host-arithmetic 30 python -m pytest -q -p no:cacheprovider -rfEs tests/kernels/test_cuda_w4a16.py -k "not nvcc"
stage gpu-kernels 90 python -m pytest -q -p no:cacheprovider -rfEs --maxfail=20 tests/gpu/test_gpu_kernels.py -k "not wgmma"
# the sm_90a wgmma kernel apart: a fault there must not cost the other kernel tests their process
stage gpu-wgmma 90 python -m pytest -q -p no:cacheprovider -rfEs tests/gpu/test_gpu_kernels.py -k wgmma
stage gpu-models 150 python -m pytest -q -p no:cacheprovider -rfEs --maxfail=20 tests/gpu/test_gpu_models.py -k "not compile and not graph and not generate"
stage gpu-model-compile-graph 90 python -m pytest -q -p no:cacheprovider -rfEs tests/gpu/test_gpu_models.py -k "compile or graph or generate"
stage gpu-offload 60 python -m pytest -q -p no:cacheprovider -rfEs tests/gpu/test_gpu_offload.py
BENCH_DIR=${OUT:-/tmp}
stage benchmark 200 python tests/gpu/bench_cuda.py --json "$BENCH_DIR/bench.json"
for i in "${!BASES[@]}"; do
  if [ -n "${BASE_BUILDS[$i]:-}" ]; then
    wait "${BASE_BUILDS[$i]}"
    rc=$?
    echo; echo "=== baseline build of ${BASES[$i]} (in the background, exit $rc):"
    cat "/tmp/hf_w4_baseline_build$i.log"
  fi
  base_env "$i"
  stage baseline-benchmark 200 "${BASE_ENV[@]}" python tests/gpu/bench_cuda.py $([ "$i" -gt 0 ] && echo --quick) \
    --json "$BENCH_DIR/bench_baseline$i.json"
done
# the first baseline against this tree, then each step of the series
if [ "${#BASES[@]}" -gt 0 ]; then
  jsons=()
  for i in "${!BASES[@]}"; do jsons+=("$BENCH_DIR/bench_baseline$i.json"); done
  jsons+=("$BENCH_DIR/bench.json")
  pairs=("${jsons[0]} ${jsons[-1]}")
  [ "${#BASES[@]}" -gt 1 ] && for i in "${!BASES[@]}"; do pairs+=("${jsons[$i]} ${jsons[$((i + 1))]}"); done
  for pair in "${pairs[@]}"; do
    stage compare 20 python tests/gpu/bench_cuda.py --compare $pair
  done
fi
# Nsight Compute: the fused kernel at two decode shapes, the largest (bandwidth) and the smallest (the fixed cost of a
# call), and the wgmma kernel (sm_90a) at M = 64 and 1024 on the largest and, forced, at M = 64 on the smallest (split
# K 8 ways), with the reasons its warps stall; the reports go to $OUT. Informational: machines whose runtime hides the
# counters (or have no wgmma kernel) pass it
if command -v ncu >/dev/null; then
  stage profile 180 bash -c 'for c in "28672 8192 1 w4a16_gemm_kernel" "4096 4096 1 w4a16_gemm_kernel" \
      "28672 8192 64 w4a16_wgmma_kernel" "28672 8192 1024 w4a16_wgmma_kernel" \
      "4096 4096 64 w4a16_wgmma_kernel HF_W4_CUDA_WGMMA=1"; do set -- $c;
    f=${OUT:-/tmp}/ncu_$1x$2_m$3.txt;
    env ${5:-HF_W4_CUDA_WGMMA=} ncu --clock-control none -k regex:$4 --launch-skip 3 --launch-count 1 \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
      --metrics smsp__inst_executed.sum,regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio \
      python tests/gpu/profile_cuda.py $1 $2 $3 int4 > "$f" 2>&1;
    grep -E "plan|Duration|DRAM Throughput|Compute \(SM\)|L2 Cache Throughput|Achieved Occupancy|Warp Cycles Per \
Issued|No Eligible|inst_executed" "$f" ||
      { echo "ncu read no counters here (informational, not a failure):"; tail -n 3 "$f"; };
    grep -E "stalled" "$f" | sort -g -k3 -r | head -n 6; done'
else
  echo; echo "=== profile: skipped (no ncu on PATH)"
fi

echo
echo "=== total $(( $(date +%s) - T0 ))s; failed stages: ${failed[*]:-none}"
[ "${#failed[@]}" -eq 0 ] && echo "=== OVERALL PASS" || echo "=== OVERALL FAIL"
[ "${#failed[@]}" -eq 0 ]
