#!/usr/bin/env bash
# Build the Ray Serve wheels a machine without network needs (the device: torch, aiohttp, grpcio,
# protobuf, msgpack, PyYAML, requests, click, filelock, prometheus-client, httpx already there), small
# enough to travel in a device call's carry (64 MiB in all): Ray's wheel is 74 MB, so it is repacked
# without what Ray Serve never loads (the Java jars, RLlib, Tune, Train, Data, the LLM library, the
# dashboard's web client: ~60 MB unpacked). scripts/device_run.sh installs them with --no-deps when
# .whl_ray/ is carried (the replica tests: STEPS=tests TEST_PATHS=tests/serve/test_ray_serve.py).
#   bash scripts/ray_carry.sh                 # -> .whl_ray/ for CPython 3.12 (the device's)
#   PY=311 DEST=/tmp/ray311 bash scripts/ray_carry.sh   # the same set for this machine's 3.11 (a local trial)
set -euo pipefail
PY=${PY:-312}
DEST=${DEST:-.whl_ray}
RAY=${RAY:-2.60.0}
GRPC=${GRPC:-1.84.0}     # the device's grpcio: grpcio-reflection must match it
# Ray Serve's own imports beyond what the device has (--no-deps: nothing else is pulled)
PACKAGES="ray==$RAY fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection annotated-doc opentelemetry-api grpcio-reflection==$GRPC
  jsonschema jsonschema-specifications referencing rpds-py"
DROP="jars rllib tune train data llm dashboard/client"
tmp=$(mktemp -d)
trap 'rm -rf $tmp' EXIT
rm -rf "$DEST" && mkdir -p "$DEST"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" \
  --platform manylinux2014_x86_64 -d "$tmp/dl" $PACKAGES
python3 -m pip install -q wheel
for whl in "$tmp"/dl/*.whl; do
  case $(basename "$whl") in
    ray-*)
      python3 -m wheel unpack -d "$tmp/unpacked" "$whl" > /dev/null
      root=$(echo "$tmp"/unpacked/ray-*)
      for d in $DROP; do rm -rf "$root/ray/$d"; done
      python3 -m wheel pack -d "$DEST" "$root" > /dev/null ;;   # rewrites RECORD for what is left
    *) cp "$whl" "$DEST/" ;;
  esac
done
du -sh "$DEST"
