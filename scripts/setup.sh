#!/usr/bin/env bash
# Sets up .venv/ on a CPU-only Debian machine: CPU torch, sglang 0.5.23 without its GPU-only
# dependencies, mooncake PG made loadable without CUDA, nixl, the plugin and its CPU testbed
# (editable), the test tools. One line per step; pip's own output goes to .venv/setup.log.
# Idempotent: a second run checks a stamp file and returns in seconds.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.setup-stamp"
LOG="$VENV/setup.log"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
# The stamp holds a hash of the inputs below: change one and setup reruns.
WANT="$(cat "$ROOT/scripts/setup.sh" "$ROOT/scripts/requirements-cpu.txt" \
  "$ROOT/scripts/skipped-deps.txt" "$ROOT/scripts/stubs/"*.c "$ROOT/scripts/native/"*.c \
  "$ROOT/pyproject.toml" "$ROOT/testbed/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  echo "setup: .venv is up to date"
  exit 0
fi
t_all=$(date +%s)
mkdir -p "$VENV"
: > "$LOG"

# step "what it does" command...: runs the command with its output in $LOG, prints one line.
step() {
  local what="$1"; shift
  local t0; t0=$(date +%s)
  echo "### $what" >> "$LOG"
  if ! "$@" >> "$LOG" 2>&1; then
    echo "setup: FAILED: $what (last lines of $LOG below)" >&2
    tail -n 30 "$LOG" >&2
    exit 1
  fi
  printf 'setup: %-72s %3d s\n' "$what" "$(( $(date +%s) - t0 ))"
}

system_libraries() {
  ldconfig -p | grep -q libibverbs.so.1 && return 0
  local sudo=""; [[ $(id -u) -ne 0 ]] && sudo="sudo"
  # Another apt (a second setup, unattended upgrades) may hold the lock: wait for it.
  $sudo apt-get -o DPkg::Lock::Timeout=300 update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get -o DPkg::Lock::Timeout=300 install -y -qq \
    libibverbs1 ibverbs-providers libnuma1 libcurl4
}
make_venv() {
  [[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
  pip_install --upgrade pip
}
pip_install() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@"; }
native_libraries() {
  # Stand-in CUDA libraries so mooncake.pg loads without a driver (they report no device).
  local stubs="$VENV/cuda-stubs"
  mkdir -p "$stubs" "$VENV/eep-native"
  gcc -shared -fPIC -O1 -Wl,-soname,libcuda.so.1 -o "$stubs/libcuda.so.1" "$ROOT/scripts/stubs/libcuda.c"
  gcc -shared -fPIC -O1 -Wl,-soname,libc10_cuda.so -o "$stubs/libc10_cuda.so" "$ROOT/scripts/stubs/libc10_cuda.c"
  gcc -shared -fPIC -O1 -Wl,-soname,libtorch_cuda.so -o "$stubs/libtorch_cuda.so" "$ROOT/scripts/stubs/empty.c"
  ln -sf libcuda.so.1 "$stubs/libcuda.so"
  # Parks Mooncake PG's busy-spinning worker thread while a CPU rank is idle (testbed cpu/idle.py).
  gcc -shared -fPIC -O2 -Wall -o "$VENV/eep-native/libeep_thread_park.so" "$ROOT/scripts/native/thread_park.c"
  # CPU engine shims must exist before SGLang's spawned children import anything
  # (testbed cpu/bootstrap.py); a .pth line runs it at interpreter start.
  local site; site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  rm -f "$site/sglang_elastic_ep_cpu.pth"
  echo "import sglang_elastic_ep_testbed.cpu.bootstrap" > "$site/sglang_elastic_ep_testbed.pth"
}
verify() {
  # pip check, less the complaints about packages skipped on purpose (scripts/skipped-deps.txt).
  # pip check writes names normalized (dashes); either spelling matches.
  local skipped; skipped="$(grep -v '^#' "$ROOT/scripts/skipped-deps.txt" | sed 's/-/[-_]/g' | paste -sd'|')"
  local unexpected
  unexpected="$("$VENV/bin/python" -m pip check 2>/dev/null \
    | grep -v -i -E "^(sglang 0\.5\.23|nixl 1\.5\.1) (requires|has requirement) ($skipped)[ =<>!~;,]" \
    | grep -v -E '^No broken requirements' || true)"
  if [[ -n "$unexpected" ]]; then
    echo "$unexpected"
    return 1
  fi
  SGLANG_USE_CPU_ENGINE=1 "$VENV/bin/python" -c \
    'import sglang, mooncake.pg, nixl, sglang_elastic_ep.plugin, sglang_elastic_ep_testbed.plugin'
}

step "system libraries Mooncake PG links (libibverbs, libnuma, libcurl)" system_libraries
step "virtual environment .venv" make_venv
# CPU torch first, so nothing later pulls a CUDA build.
step "CPU torch 2.13.0" pip_install torch==2.13.0
# --no-deps: their metadata pins CUDA torch and GPU kernels (scripts/skipped-deps.txt).
step "sglang 0.5.23, mooncake, nixl without their GPU-only dependencies (--no-deps)" \
  pip_install --no-deps sglang==0.5.23 mooncake-transfer-engine==0.3.13.post1 nixl==1.5.1 nixl-cu12==1.5.1
step "what SGLang imports on CPU, and the test tools (scripts/requirements-cpu.txt)" \
  pip_install -r "$ROOT/scripts/requirements-cpu.txt"
# --no-deps: the plugin pins sglang==0.5.23, whose metadata would pull CUDA torch.
step "the plugin and its CPU testbed, editable (--no-deps, see above)" \
  pip_install --no-deps -e "$ROOT" -e "$ROOT/testbed"
step "stand-in CUDA libraries, the thread parker, the CPU bootstrap line" native_libraries
step "verify: pip check (less the skipped GPU-only packages), imports" verify

echo "$WANT" > "$STAMP"
echo "setup: done in $(( $(date +%s) - t_all )) s"
