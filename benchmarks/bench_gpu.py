"""hf-ext against the stock Hugging Face path on one CUDA GPU: five measurements in one command (on one H100, about
4 minutes with the model builds: padding-free 57 s, chat 20 s, the ZeRO-3 eval 80 s, the save and the planner side by
side 45 s or more); JSON, and the "GPU" section of docs/benchmarks.md.

    python -m benchmarks.bench_gpu --out runs/bench/gpu_bench.json --doc docs/benchmarks.md
    python -m benchmarks.bench_gpu --dry_run --out /tmp/gpu_bench_dry.json      # CPU: tiny sizes, a few steps
    python -m benchmarks.bench_gpu --render runs/bench/gpu_bench.json --doc docs/benchmarks.md

The rows, run in this order (the most wanted first; a row that would not fit the time left, ``--budget_s``, is
skipped and said so):

1. ``padding_free``: real (non-padding) tokens per second training the SmolLM2-135M-shaped random-init chat model
   (``chat_e.data.models`` ``chat-135m``; full fine-tune, bf16 autocast, no DeepSpeed) on the dialogue rows
   bench_packing uses (chitchat + chatterbot, up to 96 + 32 tokens): stock ``transformers.Trainer`` padding each
   batch, hf-ext ``padding_free=True`` with its ``batch_rebalance`` sampler, TRL ``SFTTrainer(padding_free=True)``
   (benchmarks.packing_worker ``--paths``: one process, the paths one after the other, steady state from step
   ``pf_warmup`` on). Ratio: tokens/s ÷ stock's.
2. ``chat``: Chat-E's first streamed text and whole reply against stock ``generate`` on the same prompt ids, bf16 on
   the GPU, the same model (``LocalEngine.from_pretrained(dir, dtype="bf16", device="cuda")`` against
   ``AutoModelForCausalLM`` + ``generate``), greedy, every reply forced to ``chat_new_tokens`` tokens (bench_chat's
   prompts and runners, interleaved, p50). Stock does not stream: its first token is its whole reply; "stock, 1 new
   token" is ``generate`` with one new token, the least a stock caller waits before any text.
3. ``eval_zero3``: ``trainer.evaluate()`` wall time of stock ``Seq2SeqTrainer(predict_with_generate=True)`` against
   hf-ext's BLEU eval with the weights gathered once, under ZeRO-3 on one rank, BlenderBot-400M-distill's shape
   (random init), bf16, beam search; the generations compared row by row, BLEU scored alike (bench_eval_zero3's
   worker, one fresh process per path).
4. ``save_zero3``: the extra peak device memory (``torch.cuda.max_memory_allocated`` above the level before the
   call, the peak reset first) and the extra peak host RSS of stock ``Trainer.save_model`` against hf-ext's streaming
   save of the same ZeRO-3 (one rank, bf16) BlenderBot-400M-shaped model (bench_save's worker, one fresh process per
   path, glibc returning freed memory to the OS).
5. ``planner``: the memory planner's predicted per-device peak (hf-ext's ``TrainingArguments(plan_model=...)``, the
   plan ``args.memory_plan`` of the config it resolves) against ``torch.cuda.max_memory_allocated`` above the level
   before the model loaded, in a short real training run of that config (ZeRO-2 and ZeRO-3, one rank, bf16, the
   135M chat model, synthetic rows of ``plan_seq_len`` tokens).

Rows 1-3 are timings: each runs alone. Rows 4 and 5 measure peaks of each process's own memory, so their three
processes run at once on the GPU (``--side_by_side``, on by default on a GPU, off on a dry run): about 20 s instead of
50. Budget on one H100, estimated: start-up 8 s, row 1 35 s (the 135M build included), row 2 15 s, row 3 35 s (the
400M build included), rows 4 + 5 20 s.

DeepSpeed's optimizer runs with ``"torch_adam": true`` (hf-ext's presets): no FusedAdam JIT build. Ranks are plain
``python -m`` processes given the environment torchrun gives one rank (no console scripts needed). Everything is
offline (``HF_HUB_OFFLINE=1``): the models are random-init builds of ``chat_e.data.models``, the rows the installed
corpora.

Output: ``--out`` (JSON: per row the raw numbers, ratios, the device, versions; written after every row, so that a
stopped run keeps what it measured), ``<out>.md`` beside it (the rendered section), the launches' logs in
``<out>_logs/``. ``--doc`` rewrites each measured row's marked part of the "GPU" section
(``<!-- bench_gpu_<row> -->``), never on ``--dry_run`` (dry-run numbers are CPU numbers, not results).
``--render JSON --doc DOC`` writes a finished run's rows into DOC (when the run happened on another machine).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from benchmarks import harness

MODULE = "benchmarks.bench_gpu"
#: the rows, in the order they run (the most wanted first)
ROWS = ("padding_free", "chat", "eval_zero3", "save_zero3", "planner")
TITLES = {
    "padding_free": "Padding-free training: real tokens per second",
    "chat": "Chat-E latency: first text and whole reply",
    "eval_zero3": "Generation eval under ZeRO-3",
    "save_zero3": "16-bit save under ZeRO-3: peak memory",
    "planner": "Memory planner: predicted against measured peak",
}
#: the sizes of a run on the GPU, and of a dry run on CPU
SIZES = {
    "gpu": dict(
        chat_model="chat-135m", seq2seq_model="400m",
        pf_batch=16, pf_steps=40, pf_warmup=5, pf_n_val=48, pf_learning_rate=3e-4,
        chat_new_tokens=32, chat_prompts=6,
        eval_n=16, eval_batch=8, eval_beams=4, eval_max_length=32,
        save_shard="200MB",
        plan_configs=["zero2", "zero3"], plan_batch=8, plan_seq_len=256, plan_steps=3,
    ),
    "dry": dict(
        chat_model="chat-tiny", seq2seq_model="tiny",
        pf_batch=4, pf_steps=6, pf_warmup=2, pf_n_val=8, pf_learning_rate=3e-4,
        chat_new_tokens=8, chat_prompts=3,
        eval_n=4, eval_batch=2, eval_beams=2, eval_max_length=8,
        save_shard="200MB",
        plan_configs=["zero2", "zero3"], plan_batch=2, plan_seq_len=32, plan_steps=2,
    ),
}  # fmt: skip
#: the least time a row needs on one H100 (imports, model loads, the work; seconds): a row is skipped when less is left
MIN_SECONDS = {"padding_free": 30, "chat": 12, "eval_zero3": 25, "save_zero3": 20, "planner": 15}
DEFAULT_BUDGET_S = {"gpu": 330, "dry": 1800}
DEFAULT_ATTN = "sdpa"
SECTION = "bench_gpu"  # a row's marked part of the doc: <!-- bench_gpu_<row> -->
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
#: the environment this process started with: launches get it, not what libraries set in this process since
START_ENV = dict(os.environ)


class RowError(Exception):
    """A row could not be measured (a launch failed or ran out of time): the reason."""


# --- the run ------------------------------------------------------------------------------------------------------


class Run:
    """One run's settings, scratch space, clock and models."""

    def __init__(self, opts, cuda: bool, isolated: bool = False):
        self.opts, self.cuda, self.isolated = opts, cuda, isolated
        self.sizes = SIZES["dry" if opts.dry_run else "gpu"]
        self.started = time.perf_counter()
        self.deadline = self.started + opts.budget_s
        self.work = Path(opts.workdir) if opts.workdir else Path(tempfile.mkdtemp(prefix="bench_gpu_"))
        self.work.mkdir(parents=True, exist_ok=True)
        out = Path(opts.out)
        self.logs = out.parent / f"{out.stem}_logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.models: dict[str, Path] = {}

    def remaining(self) -> float:
        return self.deadline - time.perf_counter()

    def model(self, name: str) -> Path:
        """The random-init model ``name`` (a ``chat_e.data.models.BUILDERS`` name), built once per run."""
        if name not in self.models:
            self.models[name] = harness.ensure_model(name, self.work / "models" / name)
        return self.models[name]

    def launch_all(self, launches: list[Launch]) -> dict[str, str | None]:
        """Start every launch at once (``python -m <args>`` from the repository root, its output into
        ``<logs>/<name>.log``; with ``one_rank``, in the environment torchrun gives the only rank of a world of one)
        and wait for all of them, killing what still runs at the deadline. Per name: None when it exited 0, else
        why not (with its log's tail)."""
        limit = self.remaining()
        if limit < 5:
            return {launch.name: "no time left in the budget" for launch in launches}
        running = {}
        for launch in launches:
            log = self.logs / f"{launch.name}.log"
            cmd = [sys.executable, "-m", *map(str, launch.args)]
            f = log.open("w")
            f.write(shlex.join(cmd) + "\n")
            f.flush()
            proc = subprocess.Popen(cmd, cwd=harness.ROOT, env=child_env(launch.env, launch.one_rank), stdout=f,
                                    stderr=subprocess.STDOUT)  # fmt: skip
            running[launch.name] = (proc, f, log, time.perf_counter())
        outcome: dict[str, str | None] = {}
        while running:
            for name, (proc, f, log, started) in list(running.items()):
                code = proc.poll()
                late = code is None and time.perf_counter() > self.deadline
                if late:
                    proc.kill()
                    code = proc.wait()
                if code is None:
                    continue
                f.close()
                del running[name]
                seconds = time.perf_counter() - started
                print(
                    f"  {name}: {seconds:.1f} s ({'stopped at the deadline' if late else f'exit {code}'})", flush=True
                )
                if late:
                    outcome[name] = f"{name}: stopped at the time budget after {seconds:.0f} s (log: {log})"
                elif code != 0:
                    outcome[name] = f"{name}: exit {code} (log: {log}): " + log.read_text()[-2500:]
                else:
                    outcome[name] = None
            time.sleep(0.05)
        return outcome

    def launch(self, name: str, module_args: list, env: dict | None = None, one_rank: bool = True) -> None:
        """One :meth:`launch_all` launch; its failure raises :class:`RowError`."""
        error = self.launch_all([Launch(name, module_args, env, one_rank)])[name]
        if error:
            raise RowError(error)


@dataclass
class Launch:
    """One process of a row: ``python -m <args>``, its log named ``name``."""

    name: str
    args: list
    env: dict | None = None
    one_rank: bool = True


def child_env(extra: dict | None, one_rank: bool) -> dict:
    """This process's starting environment (nothing a library set here since: accelerate's variables, say), the
    repository importable, offline, and with ``one_rank`` the variables torchrun sets for a world of one rank."""
    env = dict(START_ENV)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(harness.ROOT), env.get("PYTHONPATH", "")) if p)
    env.pop("OMP_NUM_THREADS", None)  # as harness.launch_env: every process places its own threads
    env.update(OFFLINE_ENV, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    if one_rank:
        env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", GROUP_RANK="0",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(harness.free_port()))  # fmt: skip
    env.update({k: str(v) for k, v in (extra or {}).items()})
    return env


def gpu_smi() -> dict:
    """GPU 0 as ``nvidia-smi`` describes it (name, memory, compute mode, driver), without a CUDA context in this
    process; empty where nvidia-smi is missing or fails."""
    fields = ("name", "memory.total", "compute_mode", "driver_version")
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return {}
    lines = out.strip().splitlines()
    return dict(zip(fields, (v.strip() for v in lines[0].split(",")))) if lines else {}


def environment(cuda: bool, smi: dict, isolated: bool) -> dict:
    """Where the run happened: the GPU and the versions that matter, beside harness.host_info's host facts. With
    ``isolated`` the GPU is described by nvidia-smi alone (no CUDA context in this process)."""
    import importlib.metadata

    import torch

    env = harness.host_info()
    env["python"] = platform.python_version()
    for package in ("trl", "peft", "accelerate", "datasets"):
        try:
            env[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            env[package] = None
    env["nvidia_smi"] = smi
    if cuda and isolated:
        env.update(device=smi.get("name", "cuda"), cuda=torch.version.cuda)
    elif cuda:
        props = torch.cuda.get_device_properties(0)
        env.update(device=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                   device_memory_bytes=props.total_memory, capability=f"{props.major}.{props.minor}",
                   gpus=torch.cuda.device_count())  # fmt: skip
    else:
        env.update(device="cpu (dry run)", cuda=None)
    return env


def bf16_flag(run: Run) -> list[str]:
    return ["--bf16"] if run.cuda else []


# --- row 1: padding-free ------------------------------------------------------------------------------------------


def summarize_padding_free(results: dict, warmup: int) -> dict:
    """Per path: steady real tokens/s and samples/s (from the end of step ``warmup`` to the last step), real tokens
    trained, peak memory, eval loss; ratios to stock."""
    from benchmarks.bench_packing import steady_tokens_per_second

    paths = {}
    for path, r in results.items():
        steps = r["steps"]
        seconds = steps[-1][0] - steps[warmup - 1][0]
        peak = r.get("peak_device_increment_bytes")
        paths[path] = {
            "tokens_per_s": steady_tokens_per_second(r, warmup),
            "samples_per_s": r["global_batch"] * (len(steps) - warmup) / seconds,
            "real_tokens": steps[-1][1], "steps": len(steps), "eval_loss": r["eval_loss"],
            "final_loss": r["final_loss"],
            "peak_bytes": peak if peak is not None else r["peak_increment_bytes"],
            "peak_kind": "device" if peak is not None else "host RSS",
            "attn_implementation": r.get("attn_implementation"), "bf16": r.get("bf16"),
        }  # fmt: skip
    stock = paths["stock"]
    for m in paths.values():
        m["tokens_ratio"] = m["tokens_per_s"] / stock["tokens_per_s"]
        m["eval_loss_vs_stock"] = m["eval_loss"] / stock["eval_loss"] - 1
    return paths


def row_padding_free(run: Run) -> dict:
    s = run.sizes
    model = run.model(s["chat_model"])
    out = run.work / "padding_free" / "pf"
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = ("stock", "hf-ext", "trl")
    args = ["benchmarks.packing_worker", "--model", model, "--paths", *paths, "--config", "none",
            "--batch", s["pf_batch"], "--n_train", s["pf_batch"] * s["pf_steps"], "--n_val", s["pf_n_val"],
            "--epochs", 1, "--learning_rate", s["pf_learning_rate"], "--attn", run.opts.attn, *bf16_flag(run),
            "--out", out]  # fmt: skip
    started = time.perf_counter()
    run.launch("padding_free", args, one_rank=False)  # no DeepSpeed: no process group either
    seconds = time.perf_counter() - started
    results = {path: json.loads(Path(f"{out}.{path}.rank0.json").read_text()) for path in paths}
    summary = summarize_padding_free(results, s["pf_warmup"])
    return {
        "model": s["chat_model"], "parameters": harness.parameter_count(model), "batch": s["pf_batch"],
        "steps": s["pf_steps"], "warmup": s["pf_warmup"], "n_val": s["pf_n_val"], "attn": run.opts.attn,
        "bf16": run.cuda, "launch_seconds": round(seconds, 1), "paths": summary,
        "same_real_tokens": len({m["real_tokens"] for m in summary.values()}) == 1,
        "ratio": {"hf-ext": summary["hf-ext"]["tokens_ratio"], "trl": summary["trl"]["tokens_ratio"]},
        "raw": results,
    }  # fmt: skip


# --- row 2: Chat-E latency ----------------------------------------------------------------------------------------


def row_chat(run: Run) -> dict:
    """In this process, or with ``run.isolated`` in its own (this process then never holds a CUDA context)."""
    s = run.sizes
    model = run.model(s["chat_model"])
    if not run.isolated:
        return chat_latency(model, s["chat_model"], s["chat_new_tokens"], s["chat_prompts"], run.cuda)
    result = run.work / "chat.json"
    run.launch("chat", [MODULE, "--worker", "chat", "--model", model, "--model_name", s["chat_model"],
                        "--new_tokens", s["chat_new_tokens"], "--prompts", s["chat_prompts"], "--result", result],
               one_rank=False)  # fmt: skip
    return json.loads(result.read_text())


def chat_latency(model: Path, model_name: str, n: int, n_prompts: int, cuda: bool) -> dict:
    """Chat-E's engine against stock ``generate`` on the first ``n_prompts`` of bench_chat's prompts, ``n`` new
    tokens each, bf16 on the GPU (on CPU in a dry run)."""
    import torch

    from benchmarks import bench_chat
    from chat_e.engines.local import LocalEngine

    device = "cuda" if cuda else "cpu"
    prompts = bench_chat.PROMPTS[:n_prompts]
    engine = LocalEngine.from_pretrained(model, dtype="bf16", device=device)
    settings = engine.default_settings().replace(num_beams=1, do_sample=False, max_new_tokens=n, min_new_tokens=n)
    gen_kwargs = dict(num_beams=1, do_sample=False, max_new_tokens=n, min_new_tokens=n)
    text_of, stock = bench_chat.stock_runner(str(model), engine, gen_kwargs, dtype=torch.bfloat16, device=device)
    runners = {
        "stock": stock,
        "engine": bench_chat.engine_runner(engine, settings, stream=True),
        "stock, 1 new token": lambda prompt, text, fn=stock: fn(prompt, text, max_new_tokens=1, min_new_tokens=1),
    }
    texts = [text_of(prompt) for prompt in prompts]  # raises when stock's ids differ from the engine's
    for fn in runners.values():  # warm-up: kernels loaded, allocator filled
        fn(prompts[0], texts[0])
    names = list(runners)
    rows = {name: {"latency": [], "first": [], "replies": []} for name in names}
    for step, (prompt, text) in enumerate(zip(prompts, texts)):
        for name in names[step % len(names) :] + names[: step % len(names)]:
            reply, latency, first = runners[name](prompt, text)
            rows[name]["latency"].append(latency)
            rows[name]["first"].append(first)
            rows[name]["replies"].append(reply)
    results = {}
    for name, r in rows.items():
        tokens = [len(engine.tokenizer(x, add_special_tokens=False)["input_ids"]) for x in r["replies"]]
        results[name] = {
            "p50_s": statistics.median(r["latency"]), "first_p50_s": statistics.median(r["first"]),
            "first_streamed": name == "engine", "reply_tokens_mean": statistics.mean(tokens),
            "latencies_s": [round(x, 4) for x in r["latency"]], "first_s": [round(x, 4) for x in r["first"]],
        }  # fmt: skip
    stock_p50 = results["stock"]["p50_s"]
    same = sum(a == b for a, b in zip(rows["engine"]["replies"], rows["stock"]["replies"])) / len(prompts)
    result = {
        "model": model_name, "parameters": engine.info["parameters"], "dtype": "bf16", "device": device,
        "prompts": len(prompts), "new_tokens": n, "generation": "greedy, every reply exactly new_tokens long",
        "results": results, "same_reply_engine_vs_stock": same,
        "ratio": {"reply_p50_engine_vs_stock": results["engine"]["p50_s"] / stock_p50,
                  "first_text_p50_engine_vs_stock": results["engine"]["first_p50_s"] / stock_p50},
        "example_replies": {name: r["replies"][:2] for name, r in rows.items()},
    }  # fmt: skip
    if cuda:
        result["device_name"] = torch.cuda.get_device_name()
    del engine, runners, stock, text_of
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return result


# --- row 3: generation eval under ZeRO-3 --------------------------------------------------------------------------

EVAL_PATHS = ("stock", "gathered")


def row_eval_zero3(run: Run) -> dict:
    from benchmarks import bench_eval_zero3
    from hf_ext.runtime import Hardware

    s = run.sizes
    model = run.model(s["seq2seq_model"])
    work = run.work / "eval_zero3"
    work.mkdir(parents=True, exist_ok=True)
    opts = argparse.Namespace(per_device_eval_batch_size=s["eval_batch"])
    # the GPU's precision and bucket rules; isolated, known without asking the GPU (a CUDA context in this process)
    hardware = Hardware("cuda", True, True) if run.cuda and run.isolated else Hardware.detect()
    config = bench_eval_zero3.resolved_config(model, opts, work, world_size=1, hardware=hardware)
    paths = {}
    for path in EVAL_PATHS:
        run.launch(f"eval_zero3_{path}", [
            "benchmarks.bench_eval_zero3", "--worker", "--path", path, "--model", model, "--ds_config", config,
            "--workdir", work, "--n_eval", s["eval_n"], "--per_device_eval_batch_size", s["eval_batch"],
            "--num_beams", s["eval_beams"], "--max_length", s["eval_max_length"], *bf16_flag(run),
        ])  # fmt: skip
        paths[path] = json.loads((work / f"{path}.rank0.json").read_text())
    stock, hf = paths["stock"], paths["gathered"]
    return {
        "model": s["seq2seq_model"], "parameters": harness.parameter_count(model), "world_size": 1, "zero_stage": 3,
        "bf16": run.cuda, "eval_rows": s["eval_n"], "num_beams": s["eval_beams"], "max_length": s["eval_max_length"],
        "per_device_eval_batch_size": s["eval_batch"], "ds_config": json.loads(Path(config).read_text()),
        "paths": paths, "same_generations": hf["generations"] == stock["generations"],
        "same_bleu": hf["bleu"] == stock["bleu"],
        "ratio": {"speedup_hf_ext_vs_stock": stock["seconds"] / hf["seconds"]},
    }  # fmt: skip


# --- row 4: 16-bit save under ZeRO-3 ------------------------------------------------------------------------------

SAVE_PATHS = ("stock", "hf_ext")


def save_launches(run: Run) -> list[Launch]:
    s = run.sizes
    model = run.model(s["seq2seq_model"])
    work = run.work / "save_zero3"
    work.mkdir(parents=True, exist_ok=True)
    return [
        Launch(f"save_zero3_{path}", [
            "benchmarks.bench_save", "--worker", "--mode", "full", "--path", path, "--model", model, "--engine",
            "zero3", "--workdir", work / f"zero3_full_{path}", "--result", work / f"zero3_full_{path}.json",
            "--max_shard_size", s["save_shard"],
        ], env=harness.FREED_MEMORY_TO_OS_ENV)
        for path in SAVE_PATHS
    ]  # fmt: skip


def save_result(run: Run, side_by_side: list[str]) -> dict:
    s = run.sizes
    work = run.work / "save_zero3"
    paths = {path: json.loads((work / f"zero3_full_{path}.json").read_text()) for path in SAVE_PATHS}
    for path in SAVE_PATHS:
        shutil.rmtree(work / f"zero3_full_{path}", ignore_errors=True)  # the saved files: measured, not needed
    stock, hf = paths["stock"], paths["hf_ext"]
    ratio = {"host_rss_hf_ext_vs_stock": hf["rank0_extra_rss_bytes"] / max(1, stock["rank0_extra_rss_bytes"])}
    if "rank0_device_extra_bytes" in stock:
        ratio["device_hf_ext_vs_stock"] = hf["rank0_device_extra_bytes"] / max(1, stock["rank0_device_extra_bytes"])
    return {
        "model": s["seq2seq_model"], "parameters": hf.get("parameters"), "world_size": 1, "zero_stage": 3,
        "max_shard_size": s["save_shard"], "malloc_env": harness.FREED_MEMORY_TO_OS_ENV, "side_by_side": side_by_side,
        "paths": paths, "ratio": ratio,
    }  # fmt: skip


# --- row 5: the memory planner ------------------------------------------------------------------------------------


def planner_launches(run: Run) -> list[Launch]:
    s = run.sizes
    model = run.model(s["chat_model"])
    return [Launch("planner", [
        MODULE, "--worker", "planner", "--model", model, "--configs", *s["plan_configs"], "--batch", s["plan_batch"],
        "--seq_len", s["plan_seq_len"], "--steps", s["plan_steps"], *bf16_flag(run), "--result",
        run.work / "planner.json",
    ])]  # fmt: skip


def planner_result(run: Run, side_by_side: list[str]) -> dict:
    s = run.sizes
    configs = json.loads((run.work / "planner.json").read_text())
    return {
        "model": s["chat_model"], "world_size": 1, "micro_batch": s["plan_batch"], "seq_len": s["plan_seq_len"],
        "steps": s["plan_steps"], "bf16": run.cuda, "side_by_side": side_by_side, "configs": configs,
        "ratio": {name: c["predicted_over_measured"] for name, c in configs.items()},
    }  # fmt: skip


def planner_worker(opts) -> None:
    """One process, one rank: each config of ``opts.configs`` planned by hf-ext (``plan_model``) and trained for
    ``opts.steps`` steps, its peak measured (device memory on a GPU, RSS on CPU) above the level before the model
    loaded; each run dropped before the next."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, default_data_collator

    import hf_ext
    from benchmarks.worker import drop_trainer, engine_config
    from hf_ext.memory.measure import current_rss, peak_rss, reset_peak_rss
    from hf_ext.runtime import start_deepspeed_comm

    cuda = torch.cuda.is_available()
    vocab = AutoConfig.from_pretrained(opts.model).vocab_size
    results = {}
    for name in opts.configs:
        args = hf_ext.TrainingArguments(
            output_dir=str(Path(opts.result).with_suffix("")) + f"_{name}", per_device_train_batch_size=opts.batch,
            max_steps=opts.steps, learning_rate=1e-4, logging_steps=1, save_strategy="no", report_to=[], seed=0,
            disable_tqdm=True, bf16=opts.bf16, deepspeed=name, plan_model=opts.model, plan_seq_len=opts.seq_len,
        )  # fmt: skip
        hf_ext.prepare_run(args)
        plan = args.memory_plan
        start_deepspeed_comm()
        gc.collect()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            baseline = torch.cuda.memory_allocated()
        else:
            baseline = current_rss()
            reset_peak_rss()
        model = AutoModelForCausalLM.from_pretrained(opts.model)
        rows = harness.synthetic_dataset(max(64, opts.batch * opts.steps), vocab, opts.seq_len)
        trainer = hf_ext.Trainer(model=model, args=args, train_dataset=rows, data_collator=default_data_collator)
        del model
        trainer.train()
        if cuda:
            torch.cuda.synchronize()
        measured = (torch.cuda.max_memory_allocated() if cuda else peak_rss()) - baseline
        low, high = plan.band
        zero = (engine_config(args) or {}).get("zero_optimization", {})
        engine = getattr(trainer, "deepspeed", None)
        results[name] = {
            "plan": plan.to_dict(), "predicted_bytes": plan.total_bytes, "band": [low, high],
            "measured_bytes": measured, "measured": "device" if cuda else "host RSS", "baseline_bytes": baseline,
            "predicted_over_measured": plan.total_bytes / measured, "within_band": low <= measured <= high,
            "zero_stage": zero.get("stage"),
            "engine_zero_stage": engine.zero_optimization_stage() if engine is not None else None,
            "final_loss": next((e["loss"] for e in reversed(trainer.state.log_history) if "loss" in e), None),
        }  # fmt: skip
        print(json.dumps({name: {k: results[name][k] for k in ("predicted_bytes", "measured_bytes")}}), flush=True)
        held = [trainer]
        del trainer
        drop_trainer(held)
        if cuda:
            torch.cuda.empty_cache()
    harness.write_json(opts.result, results)
    hf_ext.end_distributed()


# --- rendering ----------------------------------------------------------------------------------------------------


def para(text: str) -> str:
    """A paragraph wrapped as docs/benchmarks.md's are (119 columns)."""
    return textwrap.fill(text, 119, break_long_words=False, break_on_hyphens=False)


def _mib(n) -> str:
    return f"{n / 2**20:,.0f} MiB"


def row_command(row: str, report: dict) -> str:
    """The command that measures ``row`` alone, with this run's settings."""
    cmd = ["python", "-m", MODULE, "--rows", row]
    if row == "padding_free" and report["settings"]["attn"] != DEFAULT_ATTN:
        cmd += ["--attn", report["settings"]["attn"]]
    if report.get("dry_run"):
        cmd.append("--dry_run")
    return shlex.join(cmd)


def device_line(report: dict) -> str:
    e = report["environment"]
    gpu = f"**{e['device']}**" + (f" (CUDA {e['cuda']})" if e.get("cuda") else "")
    return (f"{gpu}; torch {e['torch']}, transformers {e['transformers']}, DeepSpeed {e['deepspeed']}, "
            f"TRL {e.get('trl')}; {e['date']}.")  # fmt: skip


def render_padding_free(r: dict) -> str:
    head = (f"{r['model']} (random init, {r['parameters'] / 1e6:.1f}M parameters), full fine-tune, "
            f"{'bf16 autocast' if r['bf16'] else 'fp32'}, attention `{r['attn']}`, no DeepSpeed; {r['steps']} "
            f"steps of {r['batch']} dialogue rows (chitchat + chatterbot, up to 96 + 32 tokens), tokens/s from the "
            f"end of step {r['warmup']} on; the three paths one after the other in one process.")  # fmt: skip
    header = [
        "path",
        "real tokens trained",
        "real tokens/s",
        "÷ stock",
        "samples/s",
        "peak MiB",
        "eval loss",
        "vs stock",
    ]
    rows = []
    for path, m in r["paths"].items():
        rows.append([
            path, f"{m['real_tokens']:,}", f"{m['tokens_per_s']:,.0f}",
            "1" if path == "stock" else f"**{m['tokens_ratio']:.2f}×**", f"{m['samples_per_s']:.1f}",
            f"{m['peak_bytes'] / 2**20:,.0f} ({m['peak_kind']})", f"{m['eval_loss']:.4f}",
            "–" if path == "stock" else f"{100 * m['eval_loss_vs_stock']:+.2f} %",
        ])  # fmt: skip
    note = "" if r["same_real_tokens"] else "\n\nThe paths counted different real tokens: see the JSON."
    return para(head) + "\n\n" + harness.markdown_table(header, rows) + note


def render_chat(r: dict) -> str:
    head = (f"{r['model']} (random init, {r['parameters'] / 1e6:.1f}M parameters), {r['dtype']} on {r['device']}, "
            f"{r['prompts']} prompts ({r['generation']}: {r['new_tokens']} tokens), interleaved, after one warm-up "
            "reply each. Stock does not stream: its first text is its whole reply.")  # fmt: skip
    header = ["variant", "p50 whole reply (s)", "p50 first text (s)", "reply tokens", "whole reply ÷ stock",
              "first text ÷ stock"]  # fmt: skip
    res, rows = r["results"], []
    stock = res["stock"]["p50_s"]
    for name, m in res.items():
        first = f"{m['first_p50_s']:.4f}" + ("" if m["first_streamed"] else " (whole reply)")
        rows.append([name, f"{m['p50_s']:.4f}", first, f"{m['reply_tokens_mean']:.1f}", f"{m['p50_s'] / stock:.2f}",
                     f"{m['first_p50_s'] / stock:.2f}"])  # fmt: skip
    tail = f"Same reply as stock (engine): {r['same_reply_engine_vs_stock']:.0%} of the prompts."
    return para(head) + "\n\n" + harness.markdown_table(header, rows) + "\n\n" + tail


def render_eval_zero3(r: dict) -> str:
    head = (f"BlenderBot {r['model']} shape (random init, {r['parameters'] / 1e6:.1f}M parameters), ZeRO-3 on one "
            f"rank, {'bf16' if r['bf16'] else 'fp32'}, {r['eval_rows']} eval rows (validation + test), batch "
            f"{r['per_device_eval_batch_size']}, {r['num_beams']} beams, max length {r['max_length']}; one fresh "
            "process per path, the same resolved DeepSpeed config.")  # fmt: skip
    stock = r["paths"]["stock"]["seconds"]
    labels = {"stock": "stock `predict_with_generate`", "gathered": "hf-ext, weights gathered once"}
    rows = []
    for path, m in r["paths"].items():
        gen = f"{m['generation_seconds']:.2f} s" if m.get("generation_seconds") is not None else "—"
        same = "reference" if path == "stock" else ("yes" if r["same_generations"] else "NO")
        rows.append([labels.get(path, path), f"{m['seconds']:.2f} s", gen, f"{stock / m['seconds']:.2f}×",
                     f"{m['bleu']:.2f}", same])  # fmt: skip
    header = ["eval", "evaluate() wall time", "of which generation", "speed-up vs stock", "BLEU",
              "same generations as stock"]  # fmt: skip
    return para(head) + "\n\n" + harness.markdown_table(header, rows)


def render_save_zero3(r: dict) -> str:
    params = f", {r['parameters'] / 1e6:.1f}M parameters" if r.get("parameters") else ""
    head = (f"BlenderBot {r['model']} shape (random init{params}), ZeRO-3 on one rank, measured as soon as the "
            f"engine exists; `save_max_shard_size={r['max_shard_size']}`; one fresh process per save, glibc returning "
            "freed memory to the OS. Extra = the peak during the call above the level just before it.")  # fmt: skip
    if r.get("side_by_side"):
        head += (f" These processes ran side by side on the GPU: {', '.join(r['side_by_side'])} (the peaks are each "
                 "process's own; the wall times are under that sharing).")  # fmt: skip
    labels = {"stock": "stock `Trainer.save_model`", "hf_ext": "hf-ext streaming save"}
    rows = []
    for path, m in r["paths"].items():
        device = _mib(m["rank0_device_extra_bytes"]) if "rank0_device_extra_bytes" in m else "—"
        files = "1 file" if m.get("files") == 1 else f"{m.get('files')} shards + index"
        rows.append([labels.get(path, path), device, _mib(m["rank0_extra_rss_bytes"]), f"{m['seconds']:.1f} s",
                     f"{files}, {_mib(m['bytes'])}"])  # fmt: skip
    header = ["save", "peak extra device memory", "peak extra host RSS", "wall time", "output"]
    names = {"host_rss_hf_ext_vs_stock": "peak extra host RSS", "device_hf_ext_vs_stock": "peak extra device memory"}
    ratios = ", ".join(f"{names.get(k, k)} {v:.2f}" for k, v in r["ratio"].items())
    return para(head) + "\n\n" + harness.markdown_table(header, rows) + f"\n\nhf-ext ÷ stock: {ratios}."


def render_planner(r: dict) -> str:
    kind = next(iter(r["configs"].values()))["measured"] if r["configs"] else "device"
    head = (f"{r['model']} (random init), one rank, {'bf16' if r['bf16'] else 'fp32'}, micro-batch {r['micro_batch']} "
            f"× {r['seq_len']} tokens, {r['steps']} steps. Predicted: the plan hf-ext makes of the config it resolves "
            f"(`TrainingArguments(plan_model=...)`), above the process baseline; measured: peak {kind} memory above "
            "the level before the model loaded.")  # fmt: skip
    if len(r.get("side_by_side") or []) > 1:
        head += f" These processes ran side by side on the GPU: {', '.join(r['side_by_side'])} (each its own peak)."
    rows = []
    for name, c in r["configs"].items():
        low, high = c["band"]
        rows.append([name, _mib(c["predicted_bytes"]), f"{_mib(low)} – {_mib(high)}", _mib(c["measured_bytes"]),
                     f"{c['predicted_over_measured']:.2f}", "yes" if c["within_band"] else "no"])  # fmt: skip
    header = ["config", "predicted peak", "stated band", "measured peak", "predicted ÷ measured", "within band"]
    return para(head) + "\n\n" + harness.markdown_table(header, rows)


RENDER = {"padding_free": render_padding_free, "chat": render_chat, "eval_zero3": render_eval_zero3,
          "save_zero3": render_save_zero3, "planner": render_planner}  # fmt: skip


def render_row(row: str, report: dict) -> str:
    """A row's part of the doc: the device and versions, the command that measures it, its table (or why there is
    none)."""
    r = report["rows"][row]
    lines = [para(device_line(report)), f"`{row_command(row, report)}`"]
    if r.get("status") == "ok":
        lines.append(RENDER[row](r))
    else:
        lines.append(f"_Not measured: {r.get('status')}: {r.get('reason', '')[:300]}_")
    if report.get("dry_run"):
        lines.insert(0, "**DRY RUN on CPU: tiny sizes, not results.**")
    return "\n\n".join(lines)


def render(report: dict) -> str:
    """The whole "GPU" section as Markdown (every row of ``report``, each under its heading)."""
    parts = [f"Whole run: {report.get('wall_s', 0):.0f} s. `{report['command']}`"]
    for row in ROWS:
        if row in report["rows"]:
            parts.append(f"### {TITLES[row]}\n\n{render_row(row, report)}")
    return "\n\n".join(parts)


def layout() -> str:
    """The "GPU" section's headings and marked parts, each row's awaiting its first run."""
    parts = ["## GPU", para(GPU_INTRO)]
    for row in ROWS:
        parts += [f"### {TITLES[row]}", f"<!-- {SECTION}_{row} -->\n_Not measured yet: "
                  f"`{shlex.join(['python', '-m', MODULE, '--rows', row])}` on a machine with one CUDA GPU._\n"
                  f"<!-- /{SECTION}_{row} -->"]  # fmt: skip
    return "\n\n".join(parts) + "\n"


GPU_INTRO = (
    "`python -m benchmarks.bench_gpu --out runs/bench/gpu_bench.json --doc docs/benchmarks.md` measures hf-ext beside "
    "the stock Hugging Face path on one CUDA GPU, five rows in one command (about 4 minutes on one H100) "
    "(benchmarks/bench_gpu.py says what each row runs). Models are random-init builds of `chat_e.data.models` "
    "(`chat-135m`: SmolLM2-135M's shape; `400m`: BlenderBot-400M-distill's), nothing is downloaded. Each row below "
    "names the device and the command that measures it alone."
)


def write_doc(report: dict, doc: str | Path) -> list[str]:
    """Each measured row of ``report`` into its marked part of ``doc`` (the "GPU" section's layout appended first
    when ``doc`` lacks it); rows not measured leave theirs as they were. Refuses a dry run's report. Returns the rows
    written."""
    if report.get("dry_run"):
        raise ValueError("a dry run's numbers are CPU numbers, not results: not written into the doc")
    doc = Path(doc)
    text = doc.read_text(encoding="utf-8") if doc.exists() else "# Benchmarks\n"
    if f"<!-- {SECTION}_{ROWS[0]} -->" not in text:
        doc.write_text(text.rstrip("\n") + "\n\n" + layout(), encoding="utf-8")
    written = []
    for row in ROWS:
        if report["rows"].get(row, {}).get("status") == "ok":
            harness.write_section(doc, f"{SECTION}_{row}", render_row(row, report))
            written.append(row)
    return written


# --- main ---------------------------------------------------------------------------------------------------------

#: the rows measured in this process, or by launches one after the other (timings: nothing else runs meanwhile)
SEQUENTIAL = {"padding_free": row_padding_free, "chat": row_chat, "eval_zero3": row_eval_zero3}
#: the memory rows, as their launches and the result read back after them. Their numbers are per process (device and
#: host peaks above the process's own level), so their launches can run side by side on the GPU
SIDE_BY_SIDE = {"save_zero3": (save_launches, save_result), "planner": (planner_launches, planner_result)}


def steps(rows: list[str], side_by_side: bool) -> list[list[str]]:
    """The rows to measure, in :data:`ROWS` order, grouped into what runs at once: each sequential row alone, the
    memory rows together when ``side_by_side``."""
    chosen = [r for r in ROWS if r in rows]
    memory = [r for r in chosen if r in SIDE_BY_SIDE]
    grouped = [[r] for r in chosen if r in SEQUENTIAL]
    return grouped + ([memory] if side_by_side and memory else [[r] for r in memory])


def failed(err: BaseException | str) -> dict:
    if isinstance(err, str):
        return {"status": "failed", "reason": err}
    trace = "".join(traceback.format_exception(err)[-6:])
    return {"status": "failed", "reason": f"{type(err).__name__}: {err}", "traceback": trace}


def measure(run: Run, step: list[str], side_by_side: bool) -> dict[str, dict]:
    """The results of the rows of ``step``; a row's failure is recorded as such, the others still measured. The
    launches of the memory rows run all at once with ``side_by_side``, else one after the other."""
    if step[0] in SEQUENTIAL:
        try:
            return {step[0]: {"status": "ok", **SEQUENTIAL[step[0]](run)}}
        except Exception as err:
            return {step[0]: failed(err)}
    results, launches = {}, {}
    for row in step:
        try:
            launches[row] = SIDE_BY_SIDE[row][0](run)
        except Exception as err:
            results[row] = failed(err)
    every = [launch for group in launches.values() for launch in group]
    if side_by_side:
        outcome = run.launch_all(every)
    else:
        outcome = {name: error for launch in every for name, error in run.launch_all([launch]).items()}
    for row, group in launches.items():
        errors = [outcome[launch.name] for launch in group if outcome[launch.name]]
        if errors:
            results[row] = failed("; ".join(errors))
            continue
        try:
            results[row] = {
                "status": "ok",
                **SIDE_BY_SIDE[row][1](run, [launch.name for launch in every] * side_by_side),
            }
        except Exception as err:
            results[row] = failed(err)
    return results


def parse(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--out", default="runs/bench/gpu_bench.json", help="JSON results (and <out>.md, <out>_logs/)")
    p.add_argument("--doc", default=None, help="write each measured row into this Markdown file's GPU section")
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS, help="the rows to measure (default: all)")
    p.add_argument("--dry_run", action="store_true", help="CPU check of the whole command: tiny sizes, a few steps")
    p.add_argument("--budget_s", type=float, default=None,
                   help="start no row past this many seconds (default: 330 on a GPU, 1800 on a dry run)")  # fmt: skip
    p.add_argument("--attn", default=DEFAULT_ATTN, help="attn_implementation of the padding-free row's model")
    p.add_argument("--side_by_side", choices=["auto", "on", "off"], default="auto",
                   help="run the memory rows' processes at once (auto: on a GPU whose compute mode is Default, not on "
                   "a dry run)")  # fmt: skip
    p.add_argument("--isolate", choices=["auto", "on", "off"], default="auto",
                   help="keep CUDA out of this process: the chat row in its own process (auto: when the GPU's compute "
                   "mode is not Default, so that one process at a time may use it)")  # fmt: skip
    p.add_argument("--workdir", default=None, help="scratch directory (default: a new temporary one, removed)")
    p.add_argument("--render", default=None, metavar="JSON", help="only write a finished run's JSON into --doc")
    # worker side (the planner row)
    p.add_argument("--worker", choices=["planner", "chat"], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--configs", nargs="+", help=argparse.SUPPRESS)
    p.add_argument("--batch", type=int, help=argparse.SUPPRESS)
    p.add_argument("--seq_len", type=int, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    p.add_argument("--bf16", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--model_name", help=argparse.SUPPRESS)
    p.add_argument("--new_tokens", type=int, help=argparse.SUPPRESS)
    p.add_argument("--prompts", type=int, help=argparse.SUPPRESS)
    p.add_argument("--local_rank", type=int, default=-1, help=argparse.SUPPRESS)
    opts = p.parse_args(argv)
    if opts.budget_s is None:
        opts.budget_s = DEFAULT_BUDGET_S["dry" if opts.dry_run else "gpu"]
    return p, opts


def main(argv: list[str] | None = None) -> dict | None:
    parser, opts = parse(argv)
    if opts.worker == "planner":
        planner_worker(opts)
        return None
    if opts.worker == "chat":
        import torch

        result = chat_latency(
            Path(opts.model), opts.model_name, opts.new_tokens, opts.prompts, torch.cuda.is_available()
        )
        harness.write_json(opts.result, result)
        return None
    if opts.render:
        report = json.loads(Path(opts.render).read_text())
        if not opts.doc:
            parser.error("--render needs --doc")
        try:
            print(f"wrote rows {write_doc(report, opts.doc)} into {opts.doc}")
        except ValueError as err:
            parser.error(f"{opts.render}: {err}")
        return report
    if opts.dry_run and opts.doc:
        parser.error("--dry_run never writes the doc (its numbers are CPU numbers, not results): drop --doc")
    for key, value in OFFLINE_ENV.items():
        os.environ.setdefault(key, value)
    import torch

    cuda = torch.cuda.is_available()  # no CUDA context yet: that needs more than asking
    if not cuda and not opts.dry_run:
        parser.error("no CUDA GPU here: the GPU rows need one (--dry_run checks the whole command on CPU)")
    smi = gpu_smi() if cuda else {}
    # a compute mode other than Default lets one process at a time hold a context: none here, none side by side
    shared = smi.get("compute_mode", "Default") == "Default"
    isolated = {"auto": not shared, "on": True, "off": False}[opts.isolate]
    side_by_side = {"auto": cuda and shared and not opts.dry_run, "on": True, "off": False}[opts.side_by_side]
    run = Run(opts, cuda, isolated)
    report = {
        "command": harness.command(MODULE, argv), "dry_run": opts.dry_run, "budget_s": opts.budget_s,
        "settings": {**run.sizes, "attn": opts.attn, "isolated": isolated, "side_by_side": side_by_side},
        "environment": environment(cuda, smi, isolated), "rows": {},
    }  # fmt: skip
    mode = smi.get("compute_mode", "compute mode unknown")
    print(f"bench_gpu on {report['environment']['device']} ({mode}); work in {run.work}; budget "
          f"{opts.budget_s:.0f} s; isolated {isolated}, side by side {side_by_side}", flush=True)  # fmt: skip
    try:
        for step in steps(opts.rows, side_by_side):
            left = run.remaining()
            while step and left < MIN_SECONDS[step[-1]] * (not opts.dry_run):  # the least wanted row goes first
                row = step.pop()
                why = f"{left:.0f} s left of the budget, the row needs about {MIN_SECONDS[row]} s"
                report["rows"][row] = {"status": "skipped", "reason": why}
                print(f"{row}: skipped ({why})", flush=True)
            if not step:
                continue
            print(f"{' + '.join(step)}: {'; '.join(TITLES[r] for r in step)} ({left:.0f} s left)", flush=True)
            started = time.perf_counter()
            for row, result in measure(run, step, side_by_side).items():
                result["wall_s"] = round(time.perf_counter() - started, 1)
                report["rows"][row] = result
                if result.get("device_name"):  # torch's name of the GPU, from a process that used it
                    report["environment"]["device"] = result["device_name"]
                print(f"{row}: {result['status']} in {result['wall_s']} s; ratio {result.get('ratio')}"
                      + (f"; {result['reason'][-1500:]}" if result["status"] != "ok" else ""), flush=True)  # fmt: skip
            report["wall_s"] = round(time.perf_counter() - run.started, 1)
            harness.write_json(opts.out, report)  # what is measured survives a run stopped later
    finally:
        if not opts.workdir:
            shutil.rmtree(run.work, ignore_errors=True)
    report["wall_s"] = round(time.perf_counter() - run.started, 1)
    harness.write_json(opts.out, report)
    text = render(report)
    Path(opts.out).with_suffix(".md").write_text(text + "\n", encoding="utf-8")
    print(text)
    if opts.doc:
        print(f"wrote rows {write_doc(report, opts.doc)} into {opts.doc}")
    print(f"bench_gpu: {report['wall_s']:.0f} s in all; JSON {opts.out}", flush=True)
    return report


if __name__ == "__main__":
    main()
