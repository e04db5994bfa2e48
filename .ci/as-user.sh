#!/usr/bin/env bash
# Run pytest with the given args as the unprivileged user qrq-ci (created here when missing):
# the code sandbox as a normal user runs (bwrap and unshare in a user namespace, no cgroup).
# When the venv's interpreter or the checkout sits under a directory that user may not enter
# (pyenv or conda under /root), that directory is opened to it in a private mount namespace
# only: nothing changes on the host. Usage (as root): bash .ci/as-user.sh tests/test_x.py
set -euo pipefail
cd "$(dirname "$0")/.."
user=qrq-ci
id -u "$user" >/dev/null 2>&1 ||
  useradd --system --user-group --home-dir /nonexistent --shell /usr/sbin/nologin "$user"
as_user=(setpriv --reuid="$user" --regid="$user" --init-groups env HOME=/tmp PATH=/usr/bin:/bin
         ${QRQ_TEST_REDIS_DB:+QRQ_TEST_REDIS_DB=$QRQ_TEST_REDIS_DB})
run=(.venv/bin/python -m pytest -q -p no:cacheprovider "$@")

# the first directory on the way to $1 that the user may not enter, if any
blocked() {
  local path=""
  IFS=/ read -ra parts <<< "${1#/}"
  for part in "${parts[@]}"; do
    path="$path/$part"
    "${as_user[@]}" test -x "$path" || { echo "$path"; return; }
  done
}
prefix=$(.venv/bin/python -c 'import sys; print(sys.base_prefix)')
opens=""
for path in "$prefix" "$PWD"; do
  top=$(blocked "$path")
  [ -n "$top" ] && opens="$opens $top:$path"
done
[ -z "$opens" ] && exec "${as_user[@]}" "${run[@]}"

# in a private mount namespace: keep the blocked directory's content aside, cover it with an
# empty enterable tmpfs, and bind back only the paths the tests need
exec unshare --mount --propagation private bash -c '
  set -e; opens=$1; shift; hidden=$(mktemp -d); covered=""
  for pair in $opens; do
    top=${pair%%:*}; path=${pair#*:}; key=$(echo "$top" | tr / _)
    case " $covered " in *" $top "*) ;; *)
      mkdir -p "$hidden/$key"; mount --bind "$top" "$hidden/$key"
      mount -t tmpfs -o mode=755 tmpfs "$top"; covered="$covered $top";; esac
    mkdir -p "$path"; mount --rbind "$hidden/$key${path#"$top"}" "$path"
  done
  cd "$PWD"; exec "$@"' bash "$opens" "${as_user[@]}" "${run[@]}"
