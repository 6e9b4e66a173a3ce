#!/usr/bin/env bash
# README command 1: set up .venv if needed, write the tiny model, run the CPU-cluster demo.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
export SGLANG_USE_CPU_ENGINE=1
.venv/bin/python -m sglang_elastic_ep_testbed.tiny_model >/dev/null
exec .venv/bin/python -m sglang_elastic_ep_testbed.cluster.demo "$@"
