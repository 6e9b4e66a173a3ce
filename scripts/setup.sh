#!/usr/bin/env bash
# Sets up .venv/ on a CPU-only Debian machine: CPU torch, sglang 0.5.23 without its GPU-only
# dependencies, mooncake PG made loadable without CUDA, nixl, the plugin (editable), test tools.
# Idempotent: a second run checks a stamp file and returns in seconds.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
STAMP="$VENV/.setup-stamp"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null || PY=python3
# The stamp holds a hash of this script and the requirement files: change them and setup reruns.
WANT="$(cat "$ROOT/scripts/setup.sh" "$ROOT/scripts/requirements-cpu.txt" "$ROOT/scripts/stubs/"*.c "$ROOT/scripts/native/"*.c "$ROOT/pyproject.toml" | sha256sum | cut -d' ' -f1)"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
  echo "setup: .venv is up to date"
  exit 0
fi
t0=$(date +%s)

# Mooncake PG links libibverbs even when no RDMA device exists.
if ! ldconfig -p | grep -q libibverbs.so.1; then
  SUDO=""; [[ $(id -u) -ne 0 ]] && SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 ibverbs-providers libnuma1 libcurl4 >/dev/null
fi

[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip >/dev/null
# CPU torch first, so nothing later pulls a CUDA build.
"${PIP[@]}" torch==2.13.0
# sglang without its dependency list (it pins CUDA torch and GPU kernels), then what it needs on CPU.
"${PIP[@]}" --no-deps sglang==0.5.23 mooncake-transfer-engine==0.3.13.post1 nixl==1.5.1 nixl-cu12==1.5.1
"${PIP[@]}" -r "$ROOT/scripts/requirements-cpu.txt"
"${PIP[@]}" --no-deps -e "$ROOT"

# Stand-in CUDA libraries so mooncake.pg loads without a driver (they report no device).
STUBS="$VENV/cuda-stubs"
mkdir -p "$STUBS"
gcc -shared -fPIC -O1 -Wl,-soname,libcuda.so.1 -o "$STUBS/libcuda.so.1" "$ROOT/scripts/stubs/libcuda.c"
gcc -shared -fPIC -O1 -Wl,-soname,libc10_cuda.so -o "$STUBS/libc10_cuda.so" "$ROOT/scripts/stubs/libc10_cuda.c"
gcc -shared -fPIC -O1 -Wl,-soname,libtorch_cuda.so -o "$STUBS/libtorch_cuda.so" "$ROOT/scripts/stubs/empty.c"
ln -sf libcuda.so.1 "$STUBS/libcuda.so"

# Parks Mooncake PG's busy-spinning worker thread while a CPU rank is idle (cpu/idle.py).
mkdir -p "$VENV/eep-native"
gcc -shared -fPIC -O2 -Wall -o "$VENV/eep-native/libeep_thread_park.so" "$ROOT/scripts/native/thread_park.c"

# CPU engine shims must exist before SGLang's spawned children import anything (see
# python/sglang_elastic_ep/cpu/bootstrap.py); a .pth line runs it at interpreter start.
SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "import sglang_elastic_ep.cpu.bootstrap" > "$SITE/sglang_elastic_ep_cpu.pth"

echo "$WANT" > "$STAMP"
echo "setup: done in $(( $(date +%s) - t0 )) s"
