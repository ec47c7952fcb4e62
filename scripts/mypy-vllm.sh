#!/usr/bin/env bash
# mypy over kvconnector.vllm with real vLLM visible: the connector's TYPE_CHECKING imports (Request,
# SchedulerOutput, VllmConfig, KVCacheConfig, ForwardContext, ...) are vLLM 0.32's classes here, not
# the Any the workspace's `uv run mypy` (no vLLM installed) sees. Runs the workspace's mypy version,
# installed into .venv-vllm by scripts/make-vllm-env.sh; config in scripts/mypy-vllm.ini.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${KV_VLLM_VENV:-$ROOT/.venv-vllm}"
if [[ ! -x "$VENV/bin/python" ]]; then
    echo "[mypy-vllm] no $VENV: run scripts/make-vllm-env.sh first" >&2
    exit 1
fi
exec "$VENV/bin/python" -m mypy --config-file scripts/mypy-vllm.ini "$@"
