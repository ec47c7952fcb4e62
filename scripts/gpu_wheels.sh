#!/usr/bin/env bash
# Downloads into .whl/ the wheels bench/gpu_check.py needs on the lent GPU machine and its image lacks.
#
# Why: that machine has no network and no workspace install; its python3 (3.12) already holds torch,
# numpy, msgpack, click, httpx and prometheus-client. What our packages import at module level on
# the path the check runs (kvprotocol, kvconnector's EngineClient, `kvserver start --http-port 0`)
# and the image lacks is exactly these four; versions are uv.lock's.
# There: python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
# (docs/engine.md, "GPU validation", has the whole command).
#
# PY_VERSION=3.11 fetches the same pins for another interpreter (to rehearse the install here).
set -euo pipefail
cd "$(dirname "$0")/.."
PY_VERSION="${PY_VERSION:-3.12}"
DEST="${DEST:-.whl}"
WHEELS=(pyzmq==27.3.0 blake3==1.0.11 msgspec==0.23.0 lz4==4.4.5)

rm -rf "$DEST"
mkdir -p "$DEST"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$DEST" "${WHEELS[@]}"
ls -l "$DEST"
echo "total: $(du -sh "$DEST" | cut -f1) in $(ls "$DEST" | wc -l) wheels (python $PY_VERSION)"
