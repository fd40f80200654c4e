#!/usr/bin/env bash
# Every GPU check of the open issues, for a session that is lent a GPU machine (the `device`
# tool). The device image has torch, numpy, safetensors, httpx, xxhash, scikit-learn and
# prometheus-client but not Ray, fastapi or pydantic, and nothing there can reach a package
# registry, so their wheels travel with the working tree (64 MiB a call). Ray's wheel (~80 MB)
# is carried without its Java jars (32 MB; momlp runs no Java workers), so every call installs
# what it needs on its own: a machine is given back 30 s after a call, and a fresh one is bare.
# A call may run 10 minutes, so the checks come in parts, each well inside that.
#
# Here (once):      bash benchmarks/gpu_session.sh prepare
# On the device:    carry [".gpu"]:  bash benchmarks/gpu_session.sh install run core
#                   carry [".gpu"]:  bash benchmarks/gpu_session.sh install run table4
#                   carry [".gpu"]:  bash benchmarks/gpu_session.sh install run swap
# Here, no GPU:     bash benchmarks/gpu_session.sh dry-run   (every part on CPU, .venv, quick)
# A short lease:    SKIP="pipelined_load grouped_forward" bash benchmarks/gpu_session.sh ...
#
# `run PART` writes every figure as JSON lines to $OUT/figures.jsonl (or ./gpu-out here), and
# the steps' logs and the load test's report to $OUT/logs-PART.tar.gz (a call returns 8 files).
# core: pytest -m gpu, expert_load (with the host tier), pool --only cuda, the row block A/B,
# the CUDA call's parts (both again with addmm's cuBLASLt path off), serve_loadtest (without
# and with the host tier, and on CPU), grouped_forward (~6 min; ~4.5 min with
# SKIP="pipelined_load grouped_forward"; 163 s on an H200 with SKIP="pipelined_load
# grouped_forward row_block serve_loadtest_cpu", before the two cuBLASLt steps);
# table4: the paper's Table 4 at full scale, the five tasks side by side, as many seeds as
# TABLE4_BUDGET_S (default 420) allows (TABLE4_TASKS picks tasks; on an H200 one 1-D seed
# took 181 s and no 2-D or 3-D seed ended in 470 s while the prototypes' phase ran on one CPU
# thread, which now runs on the GPU: give it a call of its own); swap: the hot-swap tests
# and benchmark on the GPU;
# suite: the integration and server tests where `--device auto` means CUDA (not dry-run).
set -euo pipefail
cd "$(dirname "$0")/.."

GPU_DIR=.gpu
SITE=/tmp/momlp-site
OUT=${OUT:-$PWD/gpu-out}
# The device's Python and what it lacks (see /work/.library/device/KINDS.md).
WHEELS=(
  "ray==2.60.0" "fastapi==0.165.0" "starlette==1.10.0" "annotated-doc" "opentelemetry-api"
  "importlib-metadata" "pydantic==2.14.4" "pydantic-core==2.50.5" "pydantic-settings==2.16.3"
  "python-dotenv" "annotated-types==0.8.0" "typing-inspection==0.4.5" "uvicorn==0.54.0"
  "jsonschema" "jsonschema-specifications" "referencing" "rpds-py"
  # Not needed to run, but without it httpx's async requests (the load test's) each search
  # sys.path for it (pyproject.toml).
  "sniffio"
  # The tests' asyncio mode (pyproject.toml); the image has pytest but not this plugin.
  "pytest-asyncio==1.5.0"
)
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

prepare() {
  local exclude
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"
  grep -qx "/$GPU_DIR/" "$exclude" 2>/dev/null || echo "/$GPU_DIR/" >> "$exclude"
  rm -rf "$GPU_DIR" && mkdir -p "$GPU_DIR/wheels"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" -d "$GPU_DIR/wheels" "${WHEELS[@]}"
  local ray_wheel
  ray_wheel=$(ls "$GPU_DIR"/wheels/ray-*.whl)
  python3 - "$ray_wheel" <<'PY'
import sys, zipfile
from pathlib import Path

# The same wheel less ray/jars (Java workers) and their RECORD rows.
path = Path(sys.argv[1])
slim = path.with_suffix(".slim")
with zipfile.ZipFile(path) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
    for info in src.infolist():
        if info.filename.startswith("ray/jars/"):
            continue
        data = src.read(info)
        if info.filename.endswith(".dist-info/RECORD"):
            rows = data.decode().splitlines(keepends=True)
            data = "".join(r for r in rows if not r.startswith("ray/jars/")).encode()
        dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
slim.replace(path)
PY
  du -sh "$GPU_DIR"
}

install() {
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$GPU_DIR"/wheels/*.whl
}

step() {  # NAME CMD...: run with a time limit, log to $OUT/NAME.log, keep its JSON lines
  local name=$1; shift
  # SKIP="name ..." leaves out steps already measured, for a call that must fit a short lease.
  if [[ " ${SKIP:-} " == *" $name "* ]]; then echo "== $name: skipped (SKIP)"; return; fi
  echo "== $name: $*"
  local begin=$SECONDS
  if ! timeout -s "${STEP_SIGNAL:-TERM}" "${STEP_TIMEOUT:-150}" "$@" > "$OUT/$name.log" 2>&1; then
    echo "   $name failed (see $name.log)"
  fi
  echo "   $name: $((SECONDS - begin)) s"
  grep -h '^{' "$OUT/$name.log" >> "$OUT/figures.jsonl" || true
}

run() {  # one part (core, table4, swap or suite); each step logs and goes on if one fails
  local part=$1
  mkdir -p "$OUT"
  export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
  local python=${PYTHON:-python3} device=${DEVICE:-cuda}
  if [ "$device" = cuda ] && [ -z "${MOMLP_BENCH_MACHINE:-}" ]; then
    # The benchmarks' records name their machine (they default to this project's CPU VM).
    MOMLP_BENCH_MACHINE="$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1),"
    MOMLP_BENCH_MACHINE+=" $(nproc --all) cpus, device machine"
    export MOMLP_BENCH_MACHINE
  fi
  local quick=()
  [ -n "${QUICK:-}" ] && quick=(--quick)
  case $part in
    core)
      step nvidia nvidia-smi
      # Test modules that import what the image lacks (schemathesis, tritonclient) fail to be
      # collected; the gpu-marked tests are elsewhere and run.
      step gpu_tests "$python" -m pytest -q -m gpu -p no:cacheprovider \
        --continue-on-collection-errors tests
      step expert_load "$python" benchmarks/expert_load.py --device "$device" "${quick[@]}"
      # What a loader reading with several threads, copying each chunk as it lands, could reach.
      step pipelined_load "$python" benchmarks/pipelined_load.py --device "$device" "${quick[@]}"
      step pool_cuda "$python" benchmarks/pool.py --only cuda
      # The CUDA row block, 64 (the default) against 16 rows: cost and batch invariance.
      step row_block "$python" benchmarks/cuda_row_block.py --device "$device" "${quick[@]}"
      # Where a CUDA actor's fixed ~0.6 ms a call goes: its parts timed apart, and a profile.
      step call_cost "$python" benchmarks/cuda_call_cost.py --device "$device" "${quick[@]}"
      # The same two with addmm's cuBLASLt path off: on the H200 one addmm took 33-51 µs of
      # host time, the largest op of a call. The row block's step says if bits stay batch
      # invariant that way.
      step call_cost_nolt env DISABLE_ADDMM_CUDA_LT=1 "$python" benchmarks/cuda_call_cost.py \
        --device "$device" "${quick[@]}"
      step row_block_nolt env DISABLE_ADDMM_CUDA_LT=1 "$python" benchmarks/cuda_row_block.py \
        --device "$device" "${quick[@]}"
      # A real `momlp serve` on the device under `momlp loadtest`: VRAM per request.
      step serve_loadtest "$python" benchmarks/serve_loadtest.py --device "$device" \
        "${quick[@]}" --report "$OUT/loadtest"
      if [ "$device" = cuda ]; then
        # The same load test with a pinned host tier that holds every expert file (misses
        # become copies), then with CPU actors on the same machine.
        step serve_loadtest_tier "$python" benchmarks/serve_loadtest.py --device cuda \
          "${quick[@]}" --host-cache-bytes $((4 * 1024 * 1024 * 1024))
        step serve_loadtest_cpu "$python" benchmarks/serve_loadtest.py --device cpu
      fi
      # Issue 19 item 2: one grouped matmul over a call's experts, where grouped kernels exist.
      step grouped_forward "$python" benchmarks/grouped_forward.py --device "$device" \
        "${quick[@]}"
      ;;
    table4)
      # The five tasks side by side, one process each: their small steps leave the GPU idle
      # most of the time, so five processes share it well. Seeds run until the budget.
      local scale=(--scale full --time-budget-s "${TABLE4_BUDGET_S:-420}")
      [ -n "${QUICK:-}" ] && scale=(--quick --seeds 2)
      local task
      # TABLE4_TASKS: a short lease runs only some (e.g. "ackley2d ackley3d").
      for task in ${TABLE4_TASKS:-holder1d ackley2d ackley3d rastrigin2d rastrigin3d}; do
        STEP_TIMEOUT=${STEP_TIMEOUT:-560} step "table4_$task" "$python" \
          benchmarks/paper_table4.py "${scale[@]}" --executor local --tasks "$task" &
      done
      wait
      ;;
    swap)
      # The hot swap with one actor on the GPU: the case issue 13's bug hit hardest.
      STEP_TIMEOUT=${STEP_TIMEOUT:-240} step hot_swap_tests "$python" -m pytest -q \
        -p no:cacheprovider tests/integration/test_hot_swap.py
      step hot_swap "$python" benchmarks/hot_swap.py --quick
      ;;
    suite)
      # The integration and server tests where `--device auto` means CUDA: their actors run on
      # the GPU, one per GPU (tests that ask for two actors and count them fail for that
      # reason alone). Modules needing what the image lacks are not collected. Stopped with
      # SIGINT at the limit, so that pytest still prints what failed so far.
      STEP_SIGNAL=INT STEP_TIMEOUT=${STEP_TIMEOUT:-500} step suite "$python" -m pytest -q \
        -p no:cacheprovider --continue-on-collection-errors -m "not gpu" tests/integration \
        tests/server
      ;;
    *) echo "unknown part $part (core, table4, swap, suite)" >&2; return 2 ;;
  esac
  # At most 8 files come back from a device call: the figures stay apart, the rest is bundled.
  # One tarball a part, so that parts run in one call keep each other's logs.
  tar czf "/tmp/logs-$part.tar.gz" -C "$OUT" --exclude=./figures.jsonl --exclude='./logs-*' .
  find "$OUT" -mindepth 1 ! -name figures.jsonl ! -name 'logs-*.tar.gz' -delete
  mv "/tmp/logs-$part.tar.gz" "$OUT/"
  echo "figures: $OUT/figures.jsonl; logs and the load test's report: $OUT/logs-$part.tar.gz"
}

dry_run() {  # the install (for the device's Python) and every part on this CPU machine
  local site
  site=$(mktemp -d)
  python3 -m pip install -q --no-index --no-deps --no-compile --only-binary=:all: \
    --python-version 3.12 --implementation cp "${PLATFORMS[@]}" --target "$site" \
    "$GPU_DIR"/wheels/*.whl
  test -f "$site/ray/_raylet.so" && test -d "$site/fastapi" && echo "wheels install for 3.12"
  rm -rf "$site"
  local part
  for part in core table4 swap; do
    PYTHON=.venv/bin/python DEVICE=cpu QUICK=1 STEP_TIMEOUT=300 OUT=$PWD/gpu-out/$part run "$part"
  done
}

[ $# -gt 0 ] || { sed -n '2,29p' "$0"; exit 2; }
while [ $# -gt 0 ]; do
  case $1 in
    prepare) prepare ;;
    install) install; export PYTHONPATH="$SITE:$PWD" PATH="$SITE/bin:$PATH" ;;
    run) shift; run "${1:?run needs a part: core, table4, swap or suite}" ;;
    dry-run) dry_run ;;
    *) echo "unknown step $1" >&2; exit 2 ;;
  esac
  shift
done
