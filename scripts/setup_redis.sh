#!/usr/bin/env bash
# Install redis-server from the system's packages when it is missing (the remote tier's tests start
# one on 127.0.0.1; docs/chunk-store.md). Needs root or sudo on Debian/Ubuntu; elsewhere it says
# what to install and carries on (those tests then skip, naming the missing binary).
set -euo pipefail
if command -v redis-server >/dev/null 2>&1 || command -v valkey-server >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "setup_redis.sh: no apt-get: install redis-server (or valkey-server) with the system's package manager" >&2
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; else
    echo "setup_redis.sh: not root and no sudo: install redis-server to run the remote-tier tests" >&2
    exit 0
  fi
fi
$SUDO apt-get install -y -q redis-server >/dev/null 2>&1 || {
  $SUDO apt-get update -q >/dev/null && $SUDO apt-get install -y -q redis-server >/dev/null; }
# the Debian package starts a system service; the tests run their own server on a free port
command -v redis-server >/dev/null
echo "setup_redis.sh: $(redis-server --version | cut -d' ' -f1-3)"
