#!/usr/bin/env bash
# Every GPU check of the open issues in one command, for a session that is lent a GPU machine
# (the `device` tool). The device image has torch, numpy, safetensors, httpx, xxhash,
# scikit-learn and prometheus-client but not Ray, fastapi or pydantic, and nothing there can
# reach a package registry, so their wheels travel with the working tree. A Ray wheel (~80 MB)
# is larger than the 64 MiB one call may carry: `prepare` splits it in two, and the first two
# calls each carry one half (the machine keeps what a call left while it stays warm).
#
# Here (once):      bash benchmarks/gpu_session.sh prepare
# On the device:    call 1, carry [".gpu/a"]:  bash benchmarks/gpu_session.sh stage a
#                   call 2, carry [".gpu/b"]:  bash benchmarks/gpu_session.sh stage b install run
#                   (each call within 30 s of the last, or the machine is given back)
# Here, no GPU:     bash benchmarks/gpu_session.sh dry-run   (the same steps on CPU, .venv)
#
# `run` writes every figure as JSON lines to $OUT/figures.jsonl (or ./gpu-out here), and the
# steps' logs and the load test's report to $OUT/logs.tar.gz (a device call returns 8 files).
set -euo pipefail
cd "$(dirname "$0")/.."

GPU_DIR=.gpu
STAGE=/tmp/momlp-wheels
SITE=/tmp/momlp-site
OUT=${OUT:-$PWD/gpu-out}
# The device's Python and what it lacks (see /work/.library/device/KINDS.md).
WHEELS=(
  "ray==2.60.0" "fastapi==0.165.0" "starlette==1.10.0" "annotated-doc" "opentelemetry-api"
  "importlib-metadata" "pydantic==2.14.3" "pydantic-core==2.50.4" "pydantic-settings==2.16.3"
  "python-dotenv" "annotated-types==0.8.0" "typing-inspection==0.4.5" "uvicorn==0.54.0"
  "jsonschema" "jsonschema-specifications" "referencing" "rpds-py"
  # Not needed to run, but without it httpx's async requests (the load test's) each search
  # sys.path for it (pyproject.toml).
  "sniffio"
)
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)

prepare() {
  local exclude
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"
  grep -qx "/$GPU_DIR/" "$exclude" 2>/dev/null || echo "/$GPU_DIR/" >> "$exclude"
  rm -rf "$GPU_DIR" && mkdir -p "$GPU_DIR/wheels" "$GPU_DIR/a" "$GPU_DIR/b"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${PLATFORMS[@]}" -d "$GPU_DIR/wheels" "${WHEELS[@]}"
  local ray_wheel
  ray_wheel=$(ls "$GPU_DIR"/wheels/ray-*.whl)
  # Half of the Ray wheel in each call; the other wheels ride with the second half.
  split -n 2 -d "$ray_wheel" "$GPU_DIR/a/ray.part"
  mv "$GPU_DIR/a/ray.part01" "$GPU_DIR/b/"
  basename "$ray_wheel" > "$GPU_DIR/b/ray.name"
  find "$GPU_DIR/wheels" -name '*.whl' ! -name 'ray-*' -exec mv {} "$GPU_DIR/b/" \;
  rm -rf "$GPU_DIR/wheels"
  du -sh "$GPU_DIR"/a "$GPU_DIR"/b
}

stage() {  # copy one carried half to a place the next call still finds
  mkdir -p "$STAGE"
  cp "$GPU_DIR/$1"/* "$STAGE/"
}

install() {
  local name
  name=$(cat "$STAGE/ray.name")
  cat "$STAGE"/ray.part00 "$STAGE"/ray.part01 > "$STAGE/$name"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$STAGE"/*.whl
}

run() {  # every GPU item of issues 13 and 19; each step logs and goes on if one fails
  mkdir -p "$OUT"
  export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
  local python=${PYTHON:-python3}
  step() {
    local name=$1; shift
    echo "== $name: $*"
    if ! timeout "${STEP_TIMEOUT:-400}" "$@" > "$OUT/$name.log" 2>&1; then
      echo "   $name failed (see $name.log)"
    fi
    grep -h '^{' "$OUT/$name.log" >> "$OUT/figures.jsonl" || true
  }
  step nvidia nvidia-smi
  step gpu_tests "$python" -m pytest -q -m gpu -p no:cacheprovider tests
  local quick=()
  [ -n "${QUICK:-}" ] && quick=(--quick)
  step expert_load "$python" benchmarks/expert_load.py --device "${DEVICE:-cuda}" "${quick[@]}"
  step pool_cuda "$python" benchmarks/pool.py --only cuda
  # A real `momlp serve` on the device under `momlp loadtest`: VRAM per request.
  step serve_loadtest "$python" benchmarks/serve_loadtest.py --device "${DEVICE:-cuda}" \
    "${quick[@]}" --report "$OUT/loadtest"
  # Issue 19 item 2: one grouped matmul over a call's experts, where grouped kernels exist.
  step grouped_forward "$python" benchmarks/grouped_forward.py --device "${DEVICE:-cuda}" "${quick[@]}"
  # The hot swap with one actor on the GPU: the case issue 13's bug hit hardest.
  step hot_swap_tests "$python" -m pytest -q -p no:cacheprovider tests/integration/test_hot_swap.py
  step hot_swap "$python" benchmarks/hot_swap.py --quick
  if [ -n "${QUICK:-}" ]; then
    step table4 "$python" benchmarks/paper_table4.py --quick --executor local --tasks holder1d
  else
    step table4 "$python" benchmarks/paper_table4.py --scale full --executor local \
      --tasks holder1d --seeds 3
  fi
  # At most 8 files come back from a device call: the figures stay apart, the rest is bundled.
  tar czf /tmp/momlp-gpu-logs.tar.gz -C "$OUT" --exclude=./figures.jsonl .
  find "$OUT" -mindepth 1 ! -name figures.jsonl -delete
  mv /tmp/momlp-gpu-logs.tar.gz "$OUT/logs.tar.gz"
  echo "figures: $OUT/figures.jsonl; logs and the load test's report: $OUT/logs.tar.gz"
}

dry_run() {  # the staging and the steps on this CPU machine, with the project's own venv
  STAGE=$(mktemp -d)
  stage a && stage b
  local name
  name=$(cat "$STAGE/ray.name")
  cat "$STAGE"/ray.part00 "$STAGE"/ray.part01 > "$STAGE/$name"
  python3 -m zipfile -t "$STAGE/$name" > /dev/null && echo "ray wheel reassembled: $name"
  rm -rf "$STAGE"
  PYTHON=.venv/bin/python DEVICE=cpu QUICK=1 STEP_TIMEOUT=300 OUT=$PWD/gpu-out run
}

[ $# -gt 0 ] || { sed -n '2,17p' "$0"; exit 2; }
while [ $# -gt 0 ]; do
  case $1 in
    prepare) prepare ;;
    stage) shift; stage "$1" ;;
    install) install; export PYTHONPATH="$SITE:$PWD" ;;
    run) run ;;
    dry-run) dry_run ;;
    *) echo "unknown step $1" >&2; exit 2 ;;
  esac
  shift
done
