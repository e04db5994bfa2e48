# Sourced by .ci/trainers.sh and .ci/frameworks.sh: a virtualenv of their own, kept outside the
# clone so later runs reuse it, with qrq installed into it, and its pytest run timed.

# venv_has VENV "import a, b": creates VENV when missing; true when the imports work there
# (else pip is upgraded, ready for the caller's installs). Sets VENV and START (for timings).
venv_has() {
  VENV=$1 START=$(date +%s)
  if [ ! -x "$1/bin/python" ]; then
    mkdir -p "$(dirname "$1")" && python3 -m venv "$1"
  fi
  "$1/bin/python" -c "$2" 2>/dev/null && return 0
  "$1/bin/python" -m pip install -q --upgrade pip >/dev/null
  return 1
}

# venv_pytest WHAT [pytest args]: qrq into $VENV, then pytest there, with timings
venv_pytest() {
  local what=$1
  shift
  "$VENV/bin/python" -m pip install -q -e ".[dev,gateway]"
  echo "$what venv ready after $(( $(date +%s) - START )) s"
  "$VENV/bin/python" -m pytest -q "$@"
  echo "$what checks took $(( $(date +%s) - START )) s"
}
