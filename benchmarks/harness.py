"""What every bench shares: 2-rank launches, their environment, host facts, the synthetic dataset, statistics,
markdown tables, JSON results and the sections of docs/benchmarks.md a bench rewrites.

Rules the library owns (presets, bucket sizes, thread placement, the planner, precision) are never computed here:
the benches call hf_ext for them.
"""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from hf_ext.atomic import write_text_atomically
from hf_ext.memory.probe import PeakTensorBytes, peak_live_bytes  # noqa: F401  (one place; re-exported for the benches)
from hf_ext.sizes import GiB, MiB  # noqa: F401  (re-exported for the benches)

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
WORKER = "benchmarks.worker"  # the training worker, run as a module by the launchers
DOCS = ROOT / "docs" / "benchmarks.md"


# --- launching ----------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_env(env_extra: dict | None = None) -> dict:
    """This environment with the venv's launchers first on PATH, the repository importable, and no inherited
    ``OMP_NUM_THREADS`` (a bench sets it only when it means to: hf-ext respects a user's value)."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    env.pop("OMP_NUM_THREADS", None)
    env.update({k: str(v) for k, v in (env_extra or {}).items()})
    return env


def launcher_cmd(launcher: str, target: str | Path, nproc: int = 2) -> list[str]:
    """The command that starts ``target`` on ``nproc`` ranks under ``launcher``: ``deepspeed``, ``torchrun``,
    ``accelerate:<config yaml>`` or ``python`` (one process). ``target`` is a script path, or a module name
    (``benchmarks.worker``), which every launcher runs as ``python -m`` does."""
    target = str(target)
    module = not target.endswith(".py")
    port = str(free_port())
    if launcher == "deepspeed":
        cmd = [str(BIN / "deepspeed"), "--num_gpus", str(nproc), "--master_port", port] + ["--module"] * module
    elif launcher == "torchrun":
        cmd = [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", port] + ["-m"] * module
    elif launcher.startswith("accelerate:"):
        config = launcher.split(":", 1)[1]
        cmd = [str(BIN / "accelerate"), "launch", "--config_file", config, "--main_process_port", port]
        cmd += ["-m"] * module
    elif launcher == "python":
        cmd = [sys.executable] + ["-m"] * module
    else:
        raise ValueError(f"unknown launcher {launcher!r}")
    return cmd + [target]


def run(cmd: list[str], log: Path, env_extra: dict | None = None) -> int:
    """Run ``cmd`` from the repository root with :func:`launch_env`, its output into ``log``; the exit code."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        return subprocess.run(cmd, cwd=ROOT, env=launch_env(env_extra), stdout=f, stderr=subprocess.STDOUT).returncode


def _rank_results(out: Path) -> list[Path]:
    return [Path(f"{out}.rank{rank}.json") for rank in (0, 1)]


def finished_launch(out: Path) -> list | None:
    """The per-rank results an earlier launch to ``out`` left, when both ranks wrote theirs."""
    results = _rank_results(out)
    return [json.loads(path.read_text()) for path in results] if all(p.exists() for p in results) else None


def launch_worker(
    args: list[str],
    out: Path,
    env_extra: dict | None = None,
    launcher: str = "deepspeed",
    reuse: bool = False,
    target: str = WORKER,
):
    """One 2-rank launch of the training worker (or of the module ``target``, which takes ``--out`` as it does); its per-rank ``OUT.rank<N>.json`` results, or why there are none
    (a string with the tail of ``OUT.log``). ``reuse``: results an earlier launch to ``out`` left (an interrupted or
    partly skipped run of the same command) are read back instead of launching again."""
    if reuse and (earlier := finished_launch(out)):
        return earlier
    results = _rank_results(out)
    for path in results:
        path.unlink(missing_ok=True)
    log = Path(f"{out}.log")
    code = run(launcher_cmd(launcher, target) + [*args, "--out", str(out)], log, env_extra)
    if code != 0:
        return f"exit {code} (see {log}): " + log.read_text()[-300:].replace("\n", " ")
    return [json.loads(path.read_text()) for path in results]


class PeakRSS:
    """Peak resident memory of this process above its level at ``__enter__``, sampled by a thread."""

    def __init__(self, interval: float = 0.002):
        import psutil

        self.process, self.interval = psutil.Process(), interval

    def __enter__(self):
        gc.collect()
        self.base = self.peak = self.process.memory_info().rss
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(self.interval)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)

    @property
    def extra(self) -> int:
        return self.peak - self.base


#: glibc settings under which a process's RSS tracks its live heap bytes: blocks of 64 KiB or more are mmapped (and
#: unmapped on free), the top of the heap is trimmed on every free, and at most two arenas keep small blocks. Without
#: them glibc keeps freed pages, and a later allocation can land in pages the process already holds.
FREED_MEMORY_TO_OS_ENV = {"MALLOC_MMAP_THRESHOLD_": 65536, "MALLOC_TRIM_THRESHOLD_": 0, "MALLOC_ARENA_MAX": 2}


def available_memory() -> int:
    import psutil

    return int(psutil.virtual_memory().available)


# --- models and data ----------------------------------------------------------------------------------------------


# The blog's classification models, as their Hub configs give them (microsoft/deberta-v3-large and
# microsoft/deberta-v2-xlarge, config.json), with a 2-label head (MRPC): config only, each run initializes at random
# (``--from_config``), nothing downloaded.
_DEBERTA = dict(
    vocab_size=128100, max_position_embeddings=512, type_vocab_size=0, relative_attention=True, position_buckets=256,
    max_relative_positions=-1, norm_rel_ebd="layer_norm", share_att_key=True, pos_att_type=["p2c", "c2p"],
    position_biased_input=False, layer_norm_eps=1e-7, hidden_act="gelu", num_labels=2,
)  # fmt: skip
CLASSIFIERS = {
    "deberta-v3-large": dict(_DEBERTA, hidden_size=1024, num_hidden_layers=24, num_attention_heads=16,
                             intermediate_size=4096),
    "deberta-v2-xlarge": dict(_DEBERTA, hidden_size=1536, num_hidden_layers=24, num_attention_heads=24,
                              intermediate_size=6144, conv_kernel_size=3, conv_act="gelu"),
}  # fmt: skip


SIZE_HELP = "model to build when --model is not given: a chat_e.data.models size or a harness.CLASSIFIERS name"


def ensure_model(size: str, model_dir: str | Path | None = None) -> Path:
    """``model_dir`` (default ``runs/models/<size>``), built if it holds no model: a :data:`CLASSIFIERS` name writes
    that DeBERTa sequence classifier's config only (train it ``--from_config``); any other ``size`` is a
    :data:`chat_e.data.models.BUILDERS` name (e.g. ``tiny``, ``400m``, ``chat-tiny`` or ``smollm2``)."""
    model = Path(model_dir) if model_dir else ROOT / "runs" / "models" / size
    if (model / "config.json").exists():
        return model
    if size in CLASSIFIERS:
        from transformers import DebertaV2Config

        config = DebertaV2Config(**CLASSIFIERS[size])
        config.architectures = ["DebertaV2ForSequenceClassification"]
        config.save_pretrained(model)
        return model
    from chat_e.data.models import build_model

    build_model(model, size, seed=0)
    return model


def has_weights(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` holds weights (else only a config: a run must start ``--from_config``)."""
    return any(f for pattern in ("*.safetensors", "*.bin") for f in Path(model_dir).glob(pattern))


def parameter_count(model_dir: str | Path) -> int:
    """Parameters of the model in ``model_dir`` (built on the meta device: no weights read)."""
    import torch
    from transformers import AutoConfig

    from hf_ext.model_info import model_class

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = model_class(config)._from_config(config)
    return sum(p.numel() for p in model.parameters())


def synthetic_dataset(n: int, vocab: int, seq_len: int, seed: int = 0, num_labels: int | None = None) -> list[dict]:
    """``n`` rows of random token ids (ids 0-3 are special tokens), inputs and labels both ``seq_len`` long (a
    seq2seq target, or a decoder-only model's shifted labels): every row costs the same, so throughput and memory do
    not depend on which rows a step gets. With ``num_labels`` (a sequence classifier) each row's label is one class
    id below it."""
    import torch

    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        ids = torch.randint(4, vocab, (seq_len,), generator=g).tolist()
        if num_labels:
            labels = int(torch.randint(0, num_labels, (), generator=g))
        else:
            labels = torch.randint(4, vocab, (seq_len,), generator=g).tolist()
        rows.append({"input_ids": ids, "attention_mask": [1] * seq_len, "labels": labels})
    return rows


# --- host ---------------------------------------------------------------------------------------------------------


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def host_info() -> dict:
    """Where a bench ran: CPU, the cores this process may use (as hf-ext counts them), versions, load average."""
    import deepspeed
    import torch
    import transformers

    from hf_ext.runtime import usable_cores

    return {
        "cpu": platform.processor() or platform.machine(),
        "machine": platform.machine(),
        "cores": usable_cores(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "deepspeed": deepspeed.__version__,
        "load_average": load_average(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


# --- statistics ---------------------------------------------------------------------------------------------------

#: Student's t, two-sided 95%, by degrees of freedom (1.96 past the table)
T95 = {1: 12.71, 2: 4.30, 3: 3.18, 4: 2.78, 5: 2.57, 6: 2.45, 7: 2.36, 8: 2.31, 9: 2.26, 10: 2.23, 11: 2.20, 12: 2.18,
       13: 2.16, 14: 2.14, 15: 2.13, 16: 2.12, 17: 2.11, 18: 2.10, 19: 2.09, 20: 2.09, 25: 2.06, 30: 2.04}  # fmt: skip


def t95(df: int) -> float:
    """Two-sided 95% Student's t for ``df`` degrees of freedom; between table entries the next smaller ``df``'s
    (a wider interval)."""
    return T95[max(k for k in T95 if k <= df)] if df <= 30 else 1.96


def geometric_mean_interval(ratios: list[float]) -> tuple[float, float, float]:
    """Geometric mean of per-pair ratios and its 95% interval (a t interval on the log ratios)."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), float("nan"), float("nan")
    half = t95(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, linearly interpolated."""
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


# --- output -------------------------------------------------------------------------------------------------------


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_json(path: str | Path, data: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(path, json.dumps(data, indent=2, default=str) + "\n")
    return path


def finish(report: dict, text: str, out: str | Path | None) -> dict:
    """A bench's last step: print its Markdown ``text`` and write ``report`` as JSON to ``out`` when given."""
    print(text)
    if out:
        write_json(out, report)
    return report


def add_publish_arguments(parser, out: str | None, section: str) -> None:
    """``--out`` (the JSON results; default ``out``), ``--doc`` (a Markdown file whose section ``--section``, default
    ``section``, gets the tables): where :func:`publish` writes."""
    parser.add_argument("--out", default=out, help=f"Where to write the JSON results (default {out}).")
    parser.add_argument("--doc", default=None, help="Write the tables into this Markdown file's section.")
    parser.add_argument("--section", default=section, help=f"The section's marker name in --doc (default {section}).")


def add_served_model_argument(parser) -> None:
    """``--model``: the model a Chat-E benchmark serves (default ``make demo``'s)."""
    parser.add_argument("--model", default="runs/demo", help="The served model (default runs/demo: make demo).")


def served_model(parser, args) -> Path:
    """``--model``'s directory; a parser error naming ``make demo`` when it holds no model."""
    from hf_ext.saving.model_dir import ModelDirError, describe_model_dir

    model = Path(args.model)
    try:
        describe_model_dir(model)
    except ModelDirError:
        parser.error(f"{model} holds no model: run `make demo` first (or give --model DIR).")
    return model


def publish(module: str, argv: list[str] | None, parts: list[str], report: dict, args) -> dict:
    """A bench's end: its Markdown (the command that reproduces it, then ``parts``) into ``args.doc``'s section
    ``args.section`` when given, printed, and ``report`` (with the host's description) as JSON to ``args.out``."""
    text = "\n\n".join([f"`{command(module, argv)}`", *parts])
    if args.doc:
        write_section(args.doc, args.section, text)
    return finish({"host": host_info(), **report}, text, args.out)


def command(module: str, argv: list[str] | None) -> str:
    """The command line that reproduces this run of bench ``module`` (``benchmarks.bench_x``)."""
    return shlex.join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)])  # quoted as typed


def write_section(doc: str | Path, name: str, text: str) -> None:
    """Replace the part of ``doc`` between the markers ``<!-- name -->`` and ``<!-- /name -->`` with ``text``; where
    ``doc`` has no such part, append one. Text outside the markers (headings, notes) is never touched."""
    doc = Path(doc)
    begin, end = f"<!-- {name} -->", f"<!-- /{name} -->"
    block = f"{begin}\n{text.strip()}\n{end}"
    old = doc.read_text(encoding="utf-8") if doc.exists() else "# Benchmarks\n"
    start, stop = old.find(begin), old.find(end)
    if start >= 0 and stop > start:
        new = old[:start] + block + old[stop + len(end) :]
    else:
        new = old.rstrip("\n") + "\n\n" + block + "\n"
    doc.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomically(doc, new)
