#!/usr/bin/env bash
# The pinned Python packages that the GPU machine's image lacks (or holds in another version), as wheels for its
# Python 3.12, into .whl/ (git-ignored): scripts/gpu_check.sh installs them there with --no-index, since that machine
# reaches no package registry. DeepSpeed ships only a source archive: its wheel is built here, ops left to JIT.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
rm -rf .whl && mkdir -p .whl
# exact versions: the ones this checkout's environment was installed with
pin() { "$PY" -c "import importlib.metadata as m, sys; print(f'{sys.argv[1]}=={m.version(sys.argv[1])}')" "$1"; }
PURE=(transformers trl datasets peft huggingface_hub tokenizers hjson dill multiprocess pydantic annotated-types
      typing-inspection sacrebleu chitchat-dataset chatterbot-corpus fsspec typer)
NATIVE=(pydantic_core)
pins=(); for p in "${PURE[@]}" "${NATIVE[@]}"; do pins+=("$(pin "$p")"); done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${pins[@]}"
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl "$(pin deepspeed)"
ls -l .whl && du -sh .whl
