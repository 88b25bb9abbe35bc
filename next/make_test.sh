#!/bin/bash
# One call: make test (or make sanitize: $1 = sanitize) on this machine, its log (without pytest's progress
# dots) under $OUT. pytest from .whl where the machine has none of a usable version.
set -o pipefail
export PYTHONUNBUFFERED=1
target=${1:-test}
mkdir -p /tmp/site && python3 -m pip install -q --no-deps --no-index --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
T0=$(date +%s)
log=$OUT/make_${target}.log
echo "# make $target on an $gpu ($(nproc) cores), $(date -u +%F), commit $(cat next/head.txt)" > $log
timeout ${2:-570} make $target TEST_ARGS='--durations=15' 2>&1 | grep -vE '^[.sxXFE]+ *(\[ *[0-9]+%\])?$' | tee -a $log | tail -40
rc=${PIPESTATUS[0]}
echo "# rc=$rc, $(( $(date +%s) - T0 )) s from the command" | tee -a $log
