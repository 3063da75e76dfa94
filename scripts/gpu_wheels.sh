#!/usr/bin/env bash
# The Python packages a GPU machine with its own CUDA torch needs for the GPU tier, as wheels for its Python 3.12,
# into .whl/ (git-ignored): scripts/gpu_check.sh installs them there with --no-index, since that machine reaches no
# package registry. The set: every requirement, followed through, of the packages hf-ext and its tests import, at the
# versions this checkout's environment holds, less what a CUDA image brings itself (torch and its NVIDIA libraries,
# numpy, pandas, pyarrow; lxml, which nothing here imports). DeepSpeed ships only a source archive: its wheel is built
# here, its ops left to JIT.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
rm -rf .whl && mkdir -p .whl
mapfile -t pins < <("$PY" - <<'PYEOF'
import importlib.metadata as metadata
import re

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOTS = ["transformers", "deepspeed", "trl", "peft", "datasets", "accelerate", "sacrebleu", "chitchat-dataset",
         "chatterbot-corpus", "safetensors", "tokenizers", "pyyaml", "psutil", "filelock", "ninja"]
IMAGE = {"torch", "numpy", "pandas", "pyarrow", "triton", "lxml"}
env = dict(default_environment(), python_version="3.12", python_full_version="3.12.3", extra="")
pins, todo = {}, list(ROOTS)
while todo:
    name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
    if name in pins or name in IMAGE or name.startswith("nvidia-"):
        continue
    dist = metadata.distribution(name)
    pins[name] = dist.version
    for line in dist.requires or []:
        requirement = Requirement(line)
        if requirement.marker is None or requirement.marker.evaluate(env):
            todo.append(requirement.name)
for name, version in sorted(pins.items()):
    print(f"{name}=={version}")
PYEOF
)
wheels=(); for pin in "${pins[@]}"; do [[ $pin == deepspeed==* ]] && ds=$pin || wheels+=("$pin"); done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d .whl "${wheels[@]}" 2>&1 | grep -v "^WARNING: Location" || true
DS_BUILD_OPS=0 "$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl "$ds" 2>&1 | grep -v "^WARNING: Location" || true
echo "${#pins[@]} packages: $(ls .whl | wc -l) wheels, $(du -sh .whl | cut -f1)"
