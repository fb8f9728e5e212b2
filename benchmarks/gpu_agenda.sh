#!/usr/bin/env bash
# The GPU hour in four commands: bash benchmarks/gpu_agenda.sh A, then B, then C, then D.
#
# Each part is one call of the device tool (one H100, torch 2.11 image, no network, 10 minutes a
# command, at most 8 files back from $OUT), with the wheels of benchmarks/gpu_wheels.sh carried along
# (`carry: [".whl"]`); docs/benchmarks.md ("The GPU hour") gives the three calls exactly.
#   A, correctness: the probe (versions, SDPA backend per shape, bf16 matmul ceiling, free memory,
#      imports), the GPU test suite, the memory plan against the CUDA allocator (world 1-8 on one GPU).
#   B, llmctl vs torchtitan on the 1B shape: torchtitan with the same attention kernel class as
#      llmctl (sdpa), then with its default (flex).
#   C, FP8 vs bf16, and what the document mask costs.
#   D, LoRA and QLoRA tokens/s, MFU and memory on the Llama-3.2-1B and Llama-3.1-8B shapes.
# A first: a crash there invalidates B, C and D.
#
# Every step has its own timeout (a part's timeouts add up to under 570 s, inside the tool's 600) and
# the part never stops at a failed one: each appends
# "NAME: rc=RC SECONDSs | LAST LINE OF ITS LOG" to $OUT/summary.txt, its output in $OUT/<log>.
# Without CUDA the CUDA-only steps write "skipped: no CUDA" (rc 0) and the rest runs on CPU, which
# is how tests/benchmarks/test_gpu_agenda.py keeps this script from rotting.
#
# Environment: OUT (default /tmp/gpu-agenda-out), PYTHON (default python3), GPU_AGENDA_WHEELS (the
# wheel folder, default .whl), GPU_AGENDA_SITE (where they are installed, default /tmp/site); the
# benchmarks' own knobs (GPU_BENCH_*, MEMPLAN_CASES, DOCUMENT_MASK_SHAPE, GPU_LORA_SHAPES) pass through.
set -uo pipefail
PART=${1:-}
case $PART in
  A | B | C | D) ;;
  *)
    echo "usage: bash benchmarks/gpu_agenda.sh A|B|C|D (got '${PART}'): A correctness, B llmctl vs torchtitan, C FP8 and mask, D LoRA and QLoRA" >&2
    exit 3
    ;;
esac
cd "$(dirname "$0")/.." || exit 3
OUT=${OUT:-/tmp/gpu-agenda-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
WHEELS=${GPU_AGENDA_WHEELS:-.whl}
SITE=${GPU_AGENDA_SITE:-/tmp/site}
SUMMARY=$OUT/summary.txt
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
# Inside the repo (ignored by git): a warm device machine keeps it between the three calls.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/.inductor-cache}
: >"$SUMMARY"

# step NAME SECONDS LOG CMD...: run CMD under its own timeout, output to $OUT/LOG, one summary line.
step() {
  local name=$1 secs=$2 log=$3
  shift 3
  local t0=$SECONDS rc
  timeout --kill-after=10 "$secs" "$@" >"$OUT/$log" 2>&1
  rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    echo "timed out after ${secs}s" >>"$OUT/$log"
  fi
  echo "$name: rc=$rc $((SECONDS - t0))s | $(tail -n 1 "$OUT/$log")" >>"$SUMMARY"
}

# cuda_step: as step, but without CUDA it only records itself as skipped.
cuda_step() {
  if [ "$HAVE_CUDA" = 1 ]; then
    step "$@"
  else
    echo "skipped: no CUDA" >"$OUT/$3"
    echo "$1: rc=0 0s | skipped: no CUDA" >>"$SUMMARY"
  fi
}

# The carried wheels, into their own folder put first on the path (pip --no-deps: nothing is fetched,
# and nothing the image has, triton above all, is replaced).
install_wheels() {
  shopt -s nullglob
  local wheels=("$WHEELS"/*.whl)
  if [ ${#wheels[@]} -eq 0 ]; then
    echo "skipped: no wheels in $WHEELS (bash benchmarks/gpu_wheels.sh builds them)"
    return 0
  fi
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}" &&
    echo "installed ${#wheels[@]} wheels into $SITE: $(cd "$WHEELS" && echo *.whl)"
}

export -f install_wheels
export PY WHEELS SITE
step install 45 install.txt bash -c install_wheels
if grep -q '^installed' "$OUT/install.txt"; then
  export PYTHONPATH=$SITE:$PYTHONPATH
fi
HAVE_CUDA=0
if timeout 45 "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
  HAVE_CUDA=1
fi
if [ "$PART" != A ]; then  # A's probe records the card; B and C name it here
  { timeout 15 nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv || echo "nvidia-smi: not available"; } >"$OUT/env.txt" 2>&1
fi

case $PART in
  A)
    step probe 45 env.txt "$PY" benchmarks/gpu_probe.py
    cuda_step gpu-suite 330 pytest.txt "$PY" -m pytest -p no:cacheprovider -p no:randomly -o addopts="" -m gpu \
      tests/gpu -n 0 -v -ra --durations=0 --junitxml="$OUT/gpu-junit.xml"
    step memplan 100 memplan.txt "$PY" benchmarks/memory_plan_cuda.py --json "$OUT/memplan_cuda.json"
    ;;
  B)
    cuda_step titan-sdpa 260 titan_sdpa.txt env GPU_BENCH_SHAPES=1b GPU_BENCH_TT_ATTN=sdpa \
      "$PY" benchmarks/gpu_vs_torchtitan.py
    cuda_step titan-flex 200 titan_flex.txt env GPU_BENCH_SHAPES=1b GPU_BENCH_TT_ATTN=flex \
      "$PY" benchmarks/gpu_vs_torchtitan.py
    ;;
  C)
    cuda_step fp8 310 fp8.txt env TORCH_LOGS=graph_breaks,recompiles "$PY" benchmarks/gpu_fp8.py
    step document-mask 150 docmask.txt "$PY" benchmarks/document_mask.py
    ;;
  D)
    # GPU_LORA_SHAPES=tiny (the CPU check) runs the tiny shape in both steps
    step lora-1b 200 lora_1b.txt env GPU_LORA_SHAPES="${GPU_LORA_SHAPES:-1b}" "$PY" benchmarks/gpu_lora.py
    step lora-8b 320 lora_8b.txt env GPU_LORA_SHAPES="${GPU_LORA_SHAPES:-8b}" "$PY" benchmarks/gpu_lora.py
    ;;
esac
cat "$SUMMARY"
exit 0
