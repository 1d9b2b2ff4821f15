#!/usr/bin/env bash
# Packed MXFP4 experts on one GPU: the GPU-marked tests, then bench/moe_mxfp4.py, whose JSON goes to
# bench/figures/kernels_mxfp4_h200.json (and to $OUT when set, with the test log). Extra arguments
# go to the bench (--quick, --reps N). The device image lacks pydantic & co: a .device/site.tar.xz
# (the lead's bundle of this repo's Python deps) is unpacked to /tmp/site when present. The inner
# timeouts (240 s tests, 300 s bench) keep the whole under one 600 s device call; the bench JSON is
# rewritten after every case, so a cut run still returns what it measured.
#     bash bench/mxfp4_h200.sh [--quick]
set -u
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import pydantic, yaml" 2>/dev/null; then
  if [ -f .device/site.tar.xz ]; then
    mkdir -p /tmp/site && tar -xJf .device/site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site:${PYTHONPATH:-}
  else
    echo "pydantic/yaml missing and no .device/site.tar.xz to unpack" >&2; exit 2
  fi
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
"$PY" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; \
print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" || exit 2
LOG=/tmp/mxfp4_gpu_tests.log
timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/unit/test_gpu_mxfp4.py 2>&1 | tee "$LOG"
tests_rc=${PIPESTATUS[0]}
JSON=bench/figures/kernels_mxfp4_h200.json
timeout 300 "$PY" bench/moe_mxfp4.py --out "$JSON" "$@"
bench_rc=$?
if [ -n "${OUT:-}" ]; then cp "$LOG" "$OUT"/ ; [ -f "$JSON" ] && cp "$JSON" "$OUT"/ ; fi
echo "mxfp4: gpu tests rc=$tests_rc, bench rc=$bench_rc (json: $JSON)"
exit $(( tests_rc != 0 || bench_rc != 0 ))
