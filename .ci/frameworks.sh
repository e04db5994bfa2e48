#!/usr/bin/env bash
# RL frameworks' own judge classes against `qrq gateway`: builds a venv
# (~/.cache/qrq/venv-frameworks) with verifiers 0.4.0 (prime-rl's environments; pure Python, no
# torch, ~100 packages; its openai<3 pin is why it is not in .venv) and runs
# tests/trainers/test_frameworks_real.py there. Needs Redis on 127.0.0.1:6379 (bash .ci/test.sh starts one).
# Cold: ~3 min (install, on the shared 2-core machine); warm (venv kept): ~30 s.
# Usage: bash .ci/frameworks.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/venv.sh
if ! venv_has "${QRQ_FRAMEWORKS_VENV:-$HOME/.cache/qrq/venv-frameworks}" "import verifiers"; then
  "$VENV/bin/python" -m pip install -q verifiers==0.4.0
fi
venv_pytest framework tests/trainers/test_frameworks_real.py "$@"
