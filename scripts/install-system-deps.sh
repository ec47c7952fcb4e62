#!/usr/bin/env bash
# System packages the test suite needs (Debian): redis-server and redis-cli for the L2 tests, which
# start their own redis-server processes (standalone and a 3-node cluster); systemd-analyze and
# prometheus/promtool for the deployment and observability tests. Idempotent: apt-get runs
# only when something is missing. Needs root (or sudo) for the install itself.
set -euo pipefail

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || missing+=(redis-tools)
command -v systemd-analyze >/dev/null 2>&1 || missing+=(systemd)  # verifies deploy/systemd/kvserver.service
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)  # alert rules and dashboard queries (tests/deploy)

if [ ${#missing[@]} -eq 0 ]; then
    echo "install-system-deps: all present ($(redis-server --version | cut -d' ' -f3))"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "install-system-deps: need root to install ${missing[*]}" >&2; exit 1; }
    SUDO="sudo"
fi
echo "install-system-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
# the Debian prometheus package starts a system Prometheus on :9090; the tests start their own
if [[ " ${missing[*]} " == *" prometheus "* ]]; then $SUDO systemctl disable --now prometheus 2>/dev/null || true; fi
# the Debian package may start a system redis on 6379; the tests never use it (they pick free ports)
command -v redis-server >/dev/null && command -v redis-cli >/dev/null
