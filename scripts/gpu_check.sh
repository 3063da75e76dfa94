#!/usr/bin/env bash
# The GPU tier and the GPU benchmark rows in one command, for a borrowed GPU machine that reaches no package registry
# and has Python, a CUDA torch and the common HF packages but not this project's pins (docs/testing.md, "GPU tier").
#
#   here:  scripts/gpu_wheels.sh            # the pinned wheels it lacks, for its Python 3.12, into .whl/
#   there: OUT=DIR scripts/gpu_check.sh     # from the repository root, with .whl/ copied along
#
# Installs .whl/ into /tmp/site (no index, no dependencies), prints the versions and the device, runs `pytest
# tests/gpu` (one worker per test file, each file's launches in order) and then `python -m benchmarks.bench_gpu`.
# Logs and the benchmark JSON go to $OUT. Exit status: the tests' (the benchmark's when the tests passed).
# PYTEST_ARGS (e.g. "-k padding") narrows the tests for a rerun; SKIP_BENCH=1 leaves the benchmark out.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-runs/gpu}
PY=${PY:-python3}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" - <<'PYEOF' 2>&1 | tee "$OUT/versions.txt"
import importlib.metadata as m, torch
import accelerate, datasets, deepspeed, peft, sacrebleu, transformers, trl  # every pin imports, before any test
print("device:", torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu (no CUDA)")
for name in ("torch", "transformers", "deepspeed", "accelerate", "peft", "trl", "datasets", "tokenizers"):
    print(f"{name} {m.version(name)}")
PYEOF
[ "${PIPESTATUS[0]}" = 0 ] || exit 1
workers=()
if "$PY" -c "import xdist" 2>/dev/null; then workers=(-n 4 --dist loadfile); fi
started=$(date +%s)
HF_EXT_GPU_REPORT="$OUT/report.txt" "$PY" -m pytest tests/gpu -s -p no:cacheprovider "${workers[@]}" ${PYTEST_ARGS:-} 2>&1 \
    | tee "$OUT/test_gpu.log"
status=${PIPESTATUS[0]}
echo "pytest tests/gpu: exit $status in $(( $(date +%s) - started )) s" | tee -a "$OUT/test_gpu.log"
[ -n "${SKIP_BENCH:-}" ] && exit "$status"
started=$(date +%s)
"$PY" -m benchmarks.bench_gpu --out "$OUT/gpu_bench.json" ${BENCH_FLAGS:-} 2>&1 | tee "$OUT/bench_gpu.log"
bench=${PIPESTATUS[0]}
echo "bench_gpu: exit $bench in $(( $(date +%s) - started )) s" | tee -a "$OUT/bench_gpu.log"
# the launches' logs as one file: a device machine hands back only a few files
if [ -d "$OUT/gpu_bench_logs" ]; then tar czf "$OUT/gpu_bench_logs.tgz" -C "$OUT" gpu_bench_logs && rm -rf "$OUT/gpu_bench_logs"; fi
exit $(( status != 0 ? status : bench ))
