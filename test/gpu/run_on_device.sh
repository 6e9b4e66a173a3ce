#!/usr/bin/env bash
# Runs the GPU data-plane checks on a CUDA machine with no network: wheels come from .whl/
# (nixl-cu12==1.5.1 cp312 without its torch 2.12/2.13 extensions, to fit 64 MiB;
# nvidia-cuda-runtime-cu12==12.8.*; pydantic 2.14.4 with pydantic-core, annotated-types,
# typing-inspection, typing-extensions). Results go to $OUT (default ./out).
# Usage (repo root): bash test/gpu/run_on_device.sh
set -u
OUT="${OUT:-$PWD/out}"
mkdir -p "$OUT"
SITE=/tmp/eep-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" .whl/*.whl || exit 1
export PYTHONPATH="$SITE:$PWD/python:$PWD/sgl-kernel${PYTHONPATH:+:$PYTHONPATH}"
export LD_LIBRARY_PATH="$SITE/nvidia/cuda_runtime/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONUNBUFFERED=1
rc=0
step() {  # step NAME TIMEOUT CMD... : echo the command, run it, keep its output in $OUT/NAME.txt
  local name=$1 limit=$2
  shift 2
  {
    echo "\$ $*"
    timeout "$limit" "$@" 2>&1
    echo "[exit status $?]"
  } > "$OUT/$name.txt"
  cat "$OUT/$name.txt"
  grep -q '^\[exit status 0\]$' "$OUT/$name.txt" || rc=1
}
step env 60 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv && \
python3 -c 'import sys, torch, triton; print(sys.version.split()[0], torch.__version__, \
triton.__version__)'"
step gpu_tests 400 python3 -m pytest -q -rs -s -p no:cacheprovider \
  test/unit/test_nixl_membership.py test/unit/test_expert_select_reference.py \
  test/gpu/test_expert_select_kernel.py test/gpu/test_active_ranks_no_sync.py \
  test/gpu/test_agreement_adds_no_sync.py test/gpu/test_gather_repair_on_device.py test/gpu/test_pass_faults_on_device.py "test/unit/test_gather_agreement.py::test_the_columns_ride_in_the_row_and_come_back_from_the_host_copy" \
  "test/unit/test_gather_agreement.py::test_rows_of_every_attention_tp_rank_are_read_not_only_tp0" \
  "test/unit/test_gather_agreement.py::test_the_same_verdicts_come_out_on_every_device"
step bench 300 python3 benchmark/bench_expert_select.py
cp docs/benchmarks.md "$OUT/benchmarks.md"
step nixl 500 python3 -m pytest -q -rs -s -p no:cacheprovider test/gpu/test_nixl_ep_elastic.py \
  --basetemp=/tmp/eep-nixl
exit $rc
