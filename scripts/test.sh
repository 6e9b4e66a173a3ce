#!/usr/bin/env bash
# README command 2 (and CI): set up .venv if needed, lint, run the whole suite.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh test/unit -x`); `--long` first runs
# the whole suite plus the e2e scenarios too long for it (marker `long`, test/e2e/conftest.py).
set -euo pipefail
if [[ "${1:-}" == "--long" ]]; then
  shift
  export SGLANG_EEP_E2E_LONG=1
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
bash scripts/setup.sh
start=$(date +%s)
DIGEST=.cluster/failure-digest.txt  # written by failed cluster scenarios (LocalCluster)
RELAUNCHED=.cluster/relaunched-after-a-crash.txt  # replacements a plan relaunched after a crash
rm -f "$DIGEST" "$RELAUNCHED"
.venv/bin/ruff check python test benchmark sgl-kernel testbed
PYTEST=(.venv/bin/python -m pytest -q -rsR -p no:cacheprovider --timeout=1800 --durations=15)
if [[ $# -eq 0 ]]; then
  # Unit tests run as a fresh clone would run them by hand: without the CPU engine.
  env -u SGLANG_USE_CPU_ENGINE "${PYTEST[@]}" test/unit
fi
export SGLANG_USE_CPU_ENGINE=1  # in-process SGLang imports need the CPU shims at startup
# The cluster scenarios fork their servers from a process that imported SGLang once, for a
# start in seconds (docs/cpu-testbed.md, "Servers forked from a pre-imported process");
# SGLANG_EEP_SERVER_START=exec execs each one, as users, the demo and the benchmarks start them.
export SGLANG_EEP_SERVER_START="${SGLANG_EEP_SERVER_START:-fork}"
.venv/bin/python -m sglang_elastic_ep_testbed.tiny_model >/dev/null
rc=0
if [[ $# -eq 0 ]]; then
  "${PYTEST[@]}" test/e2e test/gpu test/integration || rc=$?  # the order `pytest test` runs them
else
  "${PYTEST[@]}" "$@" || rc=$?
fi
echo "test suite: $(( $(date +%s) - start )) s"
if [[ -s "$RELAUNCHED" ]]; then
  echo "===== replacements that crashed before they served, relaunched as an orchestrator would ($RELAUNCHED):"
  cat "$RELAUNCHED"
fi
if [[ -s "$DIGEST" ]]; then
  # Last, where a truncated CI log still shows it: what each server of a failed scenario was
  # doing (the full report is printed with the failure above).
  echo "===== failed runs of cluster scenarios (each is rerun once: see RERUN above), last lines of each server ($DIGEST):"
  cat "$DIGEST"
fi
exit "$rc"
