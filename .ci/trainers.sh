#!/usr/bin/env bash
# Tier-1 trainer checks: builds a venv (~/.cache/qrq/venv-trainers) with the real trainer code (verl 0.9.1 + TRL 1.16.0
# on CPU torch 2.13.0; OpenRLHF 0.11.2 with --no-deps, since its full pins need CUDA) and runs
# tests/trainers/test_trainers_real.py there. Needs Redis on 127.0.0.1:6379 (bash .ci/test.sh starts one).
# torch==2.13.0 resolves to the CPU build on this machine's index; elsewhere add
# --index-url https://download.pytorch.org/whl/cpu for torch, or pip pulls the multi-GB CUDA build.
# Cold: ~10 min (install ~8 min on the shared 2-core machine); warm (venv kept): ~75 s.
# Usage: bash .ci/trainers.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/venv.sh
if ! venv_has "${QRQ_TRAINERS_VENV:-$HOME/.cache/qrq/venv-trainers}" "import verl, trl, openrlhf"; then
  "$VENV/bin/python" -m pip install -q torch==2.13.0 verl==0.9.1 trl==1.16.0
  "$VENV/bin/python" -m pip install -q --no-deps openrlhf==0.11.2
fi
venv_pytest trainer tests/trainers/test_trainers_real.py "$@"
