#!/usr/bin/env bash
# Runs benchmarks/gpu_check.py on a lent GPU machine, from the repository root.
#
# The peers' pure-Python wheels travel in .whl/ (carried; git-ignored through
# `echo /.whl/ >> "$(git rev-parse --git-path info/exclude)"`), fetched once on a
# machine with pip (their needs -- torch, jax, optax -- are on the device image):
#
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
#     -d .whl rollfast==1.3.0 magma-optimizer==0.1.1
#
# (two pure-Python wheels, 236 kB; rollfast needs jax >= 0.6.2 and optax 0.2.x,
# magma-optimizer torch >= 2.0: the image has all three.)
#
# They are installed into /tmp/site; torch, jax and optax are the machine's own.
# The run keeps inside BUDGET seconds (default 330, jax import aside; sections
# that no longer fit are skipped) with a hard timeout 60 s above it. The log, the
# JSON of all numbers and a few traces land in $OUT (the device tool returns them).
#
#   device tool: command "bash benchmarks/device_run.sh", carry [".whl"],
#                timeout_s 560
#   gpu_check.py arguments pass through, e.g.
#                bash benchmarks/device_run.sh --sections roofline,dense-peers
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
BUDGET=${BUDGET:-330}
if compgen -G ".whl/*.whl" >/dev/null; then
  if python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl >"$OUT/pip.log" 2>&1; then
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "installing .whl/ failed (see pip.log): their peers will be skipped"
  fi
else
  echo "no .whl/ here: rollfast and magma-optimizer will be skipped"
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}  # this checkout's magma_optax
export PYTHONUNBUFFERED=1
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem \
    --format=csv,noheader
fi
timeout --kill-after=15 $((BUDGET + 60)) \
  python3 benchmarks/gpu_check.py --budget-s "$BUDGET" --out "$OUT" "$@"
rc=$?
echo "gpu_check.py exit status $rc"
exit $rc
