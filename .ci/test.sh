#!/usr/bin/env bash
# Install what the tests need (Debian packages, a venv with qrq[dev], Redis when none answers
# on 127.0.0.1:6379) and run the whole suite. Usage: bash .ci/test.sh [pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."

redis_up() { (exec 3<>/dev/tcp/127.0.0.1/6379 && printf 'PING\r\n' >&3 && head -c5 <&3 | grep -q PONG) 2>/dev/null; }

# Debian packages the tests use: redis-server (also for the private Redis of the restart
# tests), chromium (Flower in a real browser), tmux (`qrq status --watch` as seen in a
# terminal), bubblewrap (the code-execution sandbox)
missing=()
for pair in redis-server:redis-server redis-sentinel:redis-sentinel chromium:chromium tmux:tmux bwrap:bubblewrap; do
  command -v "${pair%%:*}" >/dev/null || missing+=("${pair##*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing ${missing[*]} (Debian packages)"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if ! redis_up; then
  echo "starting redis-server on 127.0.0.1:6379"
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no \
    --dir /tmp --logfile /tmp/qrq-ci-redis.log
  for _ in $(seq 50); do redis_up && break; sleep 0.1; done
  redis_up || { echo "redis did not start; see /tmp/qrq-ci-redis.log"; exit 1; }
fi

if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -m pip install -q -e ".[dev,rewards,docs]"
.venv/bin/ruff check .
.venv/bin/mypy  # strict on the public API; [tool.mypy] in pyproject.toml
# the documentation site (mkdocs.yml): a broken link, anchor or page left out of the nav fails
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet
.venv/bin/python -m pytest -q "$@"
# the code sandbox's guarantees again with qrq as a normal user (a whole run, as root only)
if [ $# -eq 0 ] && [ "$(id -u)" -eq 0 ]; then
  bash .ci/as-user.sh tests/sandbox/test_sandbox.py tests/sandbox/test_sandbox_guarantees.py
fi
