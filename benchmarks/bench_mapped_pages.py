"""What stays resident after an engine copies the weights ``from_pretrained`` mapped: one process, no training.

    python -m benchmarks.bench_mapped_pages --model runs/bench/save/model-400m --out runs/bench/mapped_pages_400m.json

``from_pretrained`` memory-maps the safetensors files, and the parameters start as views of the mapping (file-backed
pages, read on first touch). DeepSpeed ZeRO-1/2 copy every parameter into one flat buffer at engine start; this does
the same copy (``torch.cat`` of all parameters, each parameter then a view of the flat buffer, as DeepSpeed's
``_update_model_bit16_weights`` leaves them) and reports the process's anonymous and file-backed resident memory
(``RssAnon``, ``RssFile`` of ``/proc/self/status``) after loading, after the copy, and after a garbage collection.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

from benchmarks import harness
from benchmarks.harness import GiB


def resident() -> dict[str, float]:
    """``VmRSS``, ``RssAnon`` and ``RssFile`` of this process, GiB."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = round(int(value.split()[0]) * 1024 / GiB, 3)
    return out


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="400m", help="chat_e.data.models size to build when --model is not given")
    parser.add_argument("--model", default=None, help="model directory with safetensors weights")
    parser.add_argument("--out", default="runs/bench/mapped_pages.json")
    opts = parser.parse_args(argv)

    import torch
    from transformers import AutoConfig

    from hf_ext.model_info import model_class

    model_dir = harness.ensure_model(opts.size, opts.model)
    phases = {"start": resident()}
    model = model_class(AutoConfig.from_pretrained(model_dir)).from_pretrained(model_dir)
    phases["loaded"] = resident()
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    offset = 0
    for p in params:
        p.data = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    phases["copied"] = resident()
    gc.collect()
    phases["collected"] = resident()
    result = {
        "model": str(model_dir),
        "weight_file_gib": round(sum(f.stat().st_size for f in model_dir.glob("*.safetensors")) / GiB, 3),
        "flat_copy_gib": round(flat.numel() * flat.element_size() / GiB, 3),
        "phases": phases,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": harness.command("benchmarks.bench_mapped_pages", argv),
    }
    harness.write_json(opts.out, result)
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
