"""Clean exit under load: how often a rank of a 2-rank CPU run aborts at interpreter exit ("terminate called
without an active exception", SIGABRT) after it trained and saved, with hf-ext's ``end_distributed``, with the
teardown it replaced, and with stock transformers.

    python -m benchmarks.bench_exit --repeats 3 --out runs/bench/exit.json --logs runs/bench/exit

Each launch runs ``benchmarks/exit_worker.py`` on the tiny BlenderBot: a few steps, ``save_model`` and the stock
``save_model`` into a second directory, then the variant's teardown (see the worker). Layouts: ZeRO-3 (hf-ext's
``zero3`` preset file, the same file for stock) under ``deepspeed --num_gpus 2``, ``torchrun --nproc_per_node 2`` and
``accelerate launch`` (recipes/accelerate/zero3.yaml), and FSDP (``fsdp="full_shard"``) under torchrun and
``accelerate launch`` (recipes/accelerate/fsdp.yaml); and torch alone (``benchmarks/exit_torch_worker.py``: two
gloo collectives, the variant's teardown, exit) under torchrun, which shows whose abort it is. Each repeat runs every
layout × variant once, in the same order. Beside every launch, one busy-loop process per core (``--hogs``) loads the
machine as a full test suite does; each hog stops by itself after the launch's time limit and is killed when the
launch ends.

Every launch runs with ``PYTHONFAULTHANDLER=1``: a rank that aborts prints the Python stack of each of its threads.
The stdout and stderr of every launch that aborted, failed or hung are kept in ``--logs`` (clean launches' are
removed), and the lines of the faulthandler dump go into the JSON. A launch counts as an abort when its launcher
returned -6 or 134 or its output says a rank was aborted (:data:`ABORT_MARKERS`); any other non-zero exit, or a launch
killed at ``--timeout``, counts as another failure. Stock leaves DeepSpeed's ``/dev/shm`` workspaces behind on CPU;
the bench removes those of each launch after it (the worker names them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness

WORKER = "benchmarks.exit_worker"
ZERO3 = harness.ROOT / "hf_ext" / "deepspeed" / "presets" / "zero3.json"
ACCELERATE = harness.ROOT / "recipes" / "accelerate"
TORCH_WORKER = "benchmarks.exit_torch_worker"
#: layout name -> (launcher, the worker's engine flags, the worker); under accelerate the YAML gives the engine
LAYOUTS = {
    "ZeRO-3, deepspeed": ("deepspeed", ["--deepspeed", str(ZERO3)], WORKER),
    "ZeRO-3, torchrun": ("torchrun", ["--deepspeed", str(ZERO3)], WORKER),
    "ZeRO-3, accelerate": (f"accelerate:{ACCELERATE / 'zero3.yaml'}", [], WORKER),
    "FSDP, torchrun": ("torchrun", ["--fsdp", "full_shard"], WORKER),
    "FSDP, accelerate": (f"accelerate:{ACCELERATE / 'fsdp.yaml'}", [], WORKER),
    "torch only (gloo), torchrun": ("torchrun", [], TORCH_WORKER),
}
#: the worker's variants, as the table names them
VARIANTS = {
    "hf-ext": "hf-ext, `end_distributed()`",
    "previous": "hf-ext, previous teardown",
    "stock": "stock, no teardown",
}
#: what a launcher or a rank prints when a rank died of SIGABRT
ABORT_MARKERS = (
    "terminate called",  # libstdc++: std::terminate, e.g. a joinable std::thread destroyed
    "Fatal Python error: Aborted",  # faulthandler
    "return code = -6",  # deepspeed's launcher: "exits with return code = -6"
    "return code -6",
    "exitcode  : -6",  # torchrun's (and accelerate's) failure summary
    "SIGABRT",
)
DUMP_LINES = 80


def hog_code(seconds: float) -> str:
    """A busy loop that ends by itself after ``seconds``."""
    return f"import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


def classify(returncode: int | None, output: str) -> str:
    """``abort``, ``error`` (another non-zero exit), ``hung`` (killed at the time limit: ``returncode`` None) or
    ``clean``, from a launcher's exit code and its stdout + stderr."""
    if returncode is None:
        return "hung"
    if returncode in (-6, 134) or any(marker in output for marker in ABORT_MARKERS):
        return "abort"
    return "error" if returncode else "clean"


def engine_label(rank: dict) -> str:
    """What a rank's ``exit.rank<N>.json`` says it trained with: ``ZeRO-<stage>``, ``FSDP2`` (its parameters are
    DTensors), ``DDP``, or the wrapper's class name."""
    if rank["zero_stage"]:
        return f"ZeRO-{rank['zero_stage']}"
    if rank["dtensor_params"]:
        return "FSDP2"
    return {"DistributedDataParallel": "DDP"}.get(rank["engine"], rank["engine"])


def abort_dump(output: str, lines: int = DUMP_LINES) -> str | None:
    """The lines of ``output`` from the first abort message on (the faulthandler dump of the aborting rank)."""
    text = output.splitlines()
    starts = [i for i, line in enumerate(text) if "terminate called" in line or "Fatal Python error" in line]
    return "\n".join(text[starts[0] : starts[0] + lines]) if starts else None


def summarize(launches: list[dict]) -> list[dict]:
    """Per layout and variant, in the order first seen: launches, aborts, other failures, mean seconds, engine."""
    cells = {}
    for launch in launches:
        cells.setdefault((launch["layout"], launch["variant"]), []).append(launch)
    return [
        {
            "layout": layout,
            "variant": variant,
            "engine": next((r["engine"] for r in runs if r.get("engine")), None),
            "launches": len(runs),
            "aborts": sum(r["outcome"] == "abort" for r in runs),
            "other_failures": sum(r["outcome"] in ("error", "hung") for r in runs),
            "mean_seconds": statistics.fmean(r["seconds"] for r in runs),
            "mean_exit_seconds": statistics.fmean(exits)
            if (exits := [r["exit_seconds"] for r in runs if r.get("exit_seconds") is not None])
            else None,
        }
        for (layout, variant), runs in cells.items()
    ]


def markdown(summary: list[dict]) -> str:
    header = ["layout", "variant", "engine (as run)", "launches", "aborts", "other non-zero exits", "s / launch",
              "exit s"]  # fmt: skip
    return harness.markdown_table(header, [
        [c["layout"], VARIANTS[c["variant"]], c["engine"] or "?", c["launches"], c["aborts"], c["other_failures"],
         f"{c['mean_seconds']:.1f}", "?" if c.get("mean_exit_seconds") is None else f"{c['mean_exit_seconds']:.2f}"]
        for c in summary
    ])  # fmt: skip


def remove_shm_workspaces(out: Path) -> int:
    """Unlink the DeepSpeed ``/dev/shm`` workspaces of the launch whose ranks wrote ``OUT/shm.rank<N>``."""
    removed = 0
    for note in out.glob("shm.rank*"):
        path = Path(note.read_text().strip())
        if path.parent == Path("/dev/shm") and path.exists():
            path.unlink()
            removed += 1
    return removed


def launch(layout: str, variant: str, model_dir: Path, work: Path, logs: Path, opts) -> dict:
    """One launch of the worker with ``--hogs`` busy loops beside it; its outcome, time and the engine it ran."""
    launcher, engine_flags, worker = LAYOUTS[layout]
    out = work / "out"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = harness.launcher_cmd(launcher, worker) + [
        "--model", str(model_dir), "--out", str(out), "--variant", variant, "--steps", str(opts.steps), *engine_flags,
    ]  # fmt: skip
    stdout, stderr = work / "stdout.txt", work / "stderr.txt"
    hogs = [subprocess.Popen([sys.executable, "-c", hog_code(opts.timeout + 30)]) for _ in range(opts.hogs)]
    started = time.perf_counter()
    with stdout.open("w") as out_file, stderr.open("w") as err_file:
        proc = subprocess.Popen(
            cmd, cwd=harness.ROOT, env=harness.launch_env({"PYTHONFAULTHANDLER": 1}), stdout=out_file,
            stderr=err_file, start_new_session=True,
        )  # fmt: skip
        try:
            returncode = proc.wait(timeout=opts.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the launcher's session: its ranks
            proc.wait()
            returncode = None
    seconds, ended_at = time.perf_counter() - started, time.time()
    for hog in hogs:
        hog.kill()
        hog.wait()
    output = stdout.read_text(errors="replace") + stderr.read_text(errors="replace")
    outcome = classify(returncode, output)
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("exit.rank*.json"))]
    record = {
        "layout": layout, "variant": variant, "launcher": launcher.split(":")[0], "returncode": returncode,
        "outcome": outcome, "seconds": seconds, "ranks_torn_down": len(ranks),
        "engine": engine_label(ranks[0]) if ranks else None,
        # from the last rank's last statement to the launcher's exit: the interpreters' exits and the launcher's
        "exit_seconds": ended_at - max(done) if len(done := [r.get("finished_at") for r in ranks]) == 2
        and None not in done else None,
        "shm_workspaces_left": remove_shm_workspaces(out), "load_average": harness.load_average(),
    }  # fmt: skip
    if outcome != "clean":
        stem = logs / f"{layout.replace(', ', '-')}.{variant}.{time.strftime('%Y%m%d-%H%M%S')}"
        stem.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(stdout, f"{stem}.stdout.txt")
        shutil.copy(stderr, f"{stem}.stderr.txt")
        record.update(stderr=f"{stem}.stderr.txt", stdout=f"{stem}.stdout.txt", dump=abort_dump(output))
    return record


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="launches of each layout × variant")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per launch")
    parser.add_argument("--hogs", type=int, default=os.cpu_count() or 1, help="busy-loop processes beside a launch")
    parser.add_argument("--timeout", type=int, default=600, help="seconds before a launch counts as hung")
    parser.add_argument("--out", default="runs/bench/exit.json")
    parser.add_argument("--logs", default="runs/bench/exit", help="output of every launch that was not clean")
    parser.add_argument("--doc", default=None, help="also write the table into this Markdown file")
    parser.add_argument("--section", default="bench_exit", help="the marked section of --doc the table replaces")
    opts = parser.parse_args(argv)

    host = harness.host_info()
    launches = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = harness.ensure_model("tiny", tmp / "tiny")
        for repeat in range(opts.repeats):
            for layout in opts.layouts:
                for variant in opts.variants:
                    launches.append({"repeat": repeat, **launch(layout, variant, model_dir, tmp / "launch",
                                                                 Path(opts.logs), opts)})  # fmt: skip
                    print(json.dumps({k: v for k, v in launches[-1].items() if k != "dump"}), flush=True)
    summary = summarize(launches)
    report = {
        "command": harness.command("benchmarks.bench_exit", argv),
        "repeats": opts.repeats,
        "steps": opts.steps,
        "hogs": opts.hogs,
        "host": host,
        "load_average_end": harness.load_average(),
        "summary": summary,
        "launches": launches,
    }
    text = markdown(summary)
    if opts.doc:
        harness.write_section(opts.doc, opts.section, f"`{report['command']}`\n\n{text}")
    return harness.finish(report, text, opts.out)


if __name__ == "__main__":
    main()
