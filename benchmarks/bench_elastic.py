"""Elastic restarts: seconds from losing a node to the survivor's first training step, under torchrun elastic and
Ray Train, beside the seconds a fresh launch of the same run takes to its first step.

    python -m benchmarks.bench_elastic --repeats 2 --out runs/bench/elastic.json --doc docs/benchmarks.md

Each run is ``recipes/blenderbot.py`` (``recipes/configs/tiny.yaml``, ZeRO-2, ``--save_steps 8``,
``--resume_from_checkpoint last``, one loss line per step) on two "nodes" of this host that share only a rendezvous
point and the output directory:

* **torchrun elastic**: two agents ``torchrun --nnodes 1:2 --nproc_per_node 1 --max-restarts 1 --rdzv-backend c10d``
  (heartbeat timeout 5 s, as in ``tests/distributed/test_multinode.py``);
* **Ray Train**: a local cluster of two nodes of one CPU each (``ray.cluster_utils.Cluster``; a node is declared dead
  after 3 missed health checks 0.5 s apart), and the recipe's ``--launcher ray --num_workers 1:2 --max_failures 1``.

Once checkpoint-8 is complete, the second node is SIGKILLed (its agent or raylet, and its rank). The survivor's
launcher notices, re-forms a 1-rank world and restarts the rank, which converts the 2-rank ZeRO checkpoint and
resumes it with the global batch kept. The ranks write their own wall-clock milestones (``tests/launched/
step_clock.py``: the Trainer's ``on_train_begin``, after the checkpoint is loaded, and every step's end), so the
times do not depend on how fast a launcher forwards its workers' output. The table splits the restart into "to
training again" (failure detection, rendezvous or a new worker group, process start, imports, model load, the
checkpoint's conversion and load) and the first resumed step; the cold start is the same command's launch to the end
of its first step. Steps trained after checkpoint-8 and before the kill are trained again ("steps redone").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

from benchmarks import harness

RECIPE = harness.ROOT / "recipes" / "blenderbot.py"
TINY = harness.ROOT / "recipes" / "configs" / "tiny.yaml"
LAUNCHERS = ("torchrun elastic", "Ray Train")
ELASTIC = ["--nnodes", "1:2", "--nproc_per_node", "1", "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-id",
           "bench", "--rdzv-conf", "last_call_timeout=5,heartbeat_timeout=5,keep_alive_interval=1"]  # fmt: skip
RAY_HEALTH = {"health_check_period_ms": 500, "health_check_failure_threshold": 3, "health_check_initial_delay_ms": 0}
CLOCK_SITE = harness.ROOT / "tests" / "launched"
RESUMING = re.compile(r"Resuming checkpoint-(\d+) \(written on 2 ranks\) on 1")
CONVERTED = re.compile(r"converted in ([\d.]+) s")


def recipe_args(out: Path, steps: int) -> list[str]:
    return ["--config", str(TINY), "--output_dir", str(out), "--max_steps", str(steps), "--samples_to_print", "0",
            "--do_eval", "false", "--deepspeed", "zero2", "--save_strategy", "steps", "--save_steps", "8",
            "--resume_from_checkpoint", "last", "--logging_steps", "1"]  # fmt: skip


class Output:
    """Every line of some processes' output (one reader thread per process), kept for the run's log."""

    def __init__(self):
        self.lines: list[str] = []

    def follow(self, proc: subprocess.Popen, source: int) -> None:
        def read():
            for line in proc.stdout:
                self.lines.append(f"[{source}] {line}")

        threading.Thread(target=read, daemon=True).start()


def clock_env(path: Path) -> dict:
    """The variables that make every rank write its milestones to ``path`` (tests/launched on PYTHONPATH)."""
    return {"HF_EXT_TEST_CLOCK": str(path), "PYTHONPATH": f"{CLOCK_SITE}{os.pathsep}{harness.ROOT}"}


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def popen(cmd: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=harness.ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip


def kill_tree(pid: int) -> None:
    process = psutil.Process(pid)
    for p in [process, *process.children(recursive=True)]:
        p.kill()


def wait_for(condition, procs: list[subprocess.Popen], seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
            raise RuntimeError(f"{what}: not reached (exit codes {[p.poll() for p in procs]})")
        time.sleep(0.02)


def torchrun_elastic(work: Path, steps: int, output: Output, clock: Path):
    """Two elastic agents; returns them and the function that kills the second node."""
    port = harness.free_port()
    cmd = [str(harness.BIN / "torchrun"), *ELASTIC, "--rdzv-endpoint", f"127.0.0.1:{port}", str(RECIPE),
           *recipe_args(work / "out", steps)]  # fmt: skip
    env = harness.launch_env(clock_env(clock))
    nodes = [popen(cmd, env)]
    output.follow(nodes[0], 0)
    wait_for(lambda: listening(port), nodes, 120, "the first agent's rendezvous store")
    nodes.append(popen(cmd, env))
    output.follow(nodes[1], 1)
    return nodes, lambda: kill_tree(nodes[1].pid)


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


def ray_train(work: Path, steps: int, output: Output, cluster):
    """The recipe's Ray driver on ``cluster``; returns it and the function that removes the cluster's second node."""
    cmd = [sys.executable, str(RECIPE), *recipe_args(work / "out", steps), "--launcher", "ray", "--num_workers", "1:2",
           "--max_failures", "1", "--ray_storage", str(work / "ray")]  # fmt: skip
    env = harness.launch_env({"RAY_ADDRESS": cluster.address, "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "15"})
    driver = popen(cmd, env)
    output.follow(driver, 0)
    second = cluster.second
    return [driver], lambda: cluster.remove_node(second, allow_graceful=False)


class LocalRay:
    """A head and a second node of one CPU each on this host (Ray's own test cluster), started fresh per run. Ray's
    workers are started by its nodes, so they get the clock's variables from this process's environment."""

    def __init__(self, clock: Path):
        # the venv's bin first on PATH, as for every launch here: DeepSpeed's op is rebuilt by another ninja
        # (scripts/build_deepspeed_ops.py)
        path = f"{harness.BIN}{os.pathsep}{os.environ.get('PATH', '')}"
        self.env = {"RAY_AUTH_MODE": "disabled", "PATH": path, **clock_env(clock)}

    def __enter__(self):
        self.saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, connect=False, head_node_args={
            "num_cpus": 1, "include_dashboard": False, "_system_config": RAY_HEALTH})  # fmt: skip
        self.cluster.second = self.cluster.add_node(num_cpus=1)
        self.cluster.wait_for_nodes()
        return self.cluster

    def __exit__(self, *exc):
        self.cluster.shutdown()
        for k, v in self.saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def one_run(launcher: str, work: Path, steps: int) -> dict:
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    output, clock = Output(), work / "clock.jsonl"
    ray = LocalRay(clock) if launcher == "Ray Train" else None
    procs: list[subprocess.Popen] = []
    try:
        cluster = ray.__enter__() if ray else None
        started = time.time()
        procs, kill = ray_train(work, steps, output, cluster) if ray else torchrun_elastic(work, steps, output, clock)

        def step_events(after: float) -> list[dict]:
            return [e for e in events(clock) if e["event"] == "step" and e["time"] >= after]

        wait_for(lambda: step_events(started), procs, 600, "the first step")
        if ray is None:
            complete = lambda: (work / "out" / "checkpoint-8").is_dir()  # noqa: E731 (renamed into place when whole)
        else:  # both ranks' files reported to Ray
            rank1 = "checkpoint-8/global_step8/zero_pp_rank_1_mp_rank_00_optim_states.pt"
            complete = lambda: bool(list((work / "ray").glob(f"*/{rank1}")))  # noqa: E731
        wait_for(complete, procs, 600, "checkpoint-8")
        killed = time.time()
        kill()
        survivor = procs[0]
        wait_for(lambda: step_events(killed), [survivor], 600, "the first step after the restart")
        code = survivor.wait(timeout=900)
        if code != 0:
            raise RuntimeError(f"{launcher}: the survivor exited {code}")
        first = min(e["time"] for e in step_events(started))
        before = max(e["step"] for e in step_events(started) if e["time"] < killed)
        begin = min((e for e in events(clock) if e["event"] == "train_begin" and e["time"] >= killed),
                    key=lambda e: e["time"])  # fmt: skip
        again = min(e["time"] for e in step_events(begin["time"]))  # a step in flight at the kill may still end
        resumed = [int(m.group(1)) for line in output.lines if (m := RESUMING.search(line))]
        converted = [float(m.group(1)) for line in output.lines if (m := CONVERTED.search(line))]
        return {"launcher": launcher, "cold_start_s": round(first - started, 2), "restart_s": round(again - killed, 2),
                "to_training_s": round(begin["time"] - killed, 2), "first_step_s": round(again - begin["time"], 2),
                "ratio": round((again - killed) / (first - started), 3), "resumed_checkpoint": resumed,
                "resumed_at_step": begin["step"], "steps_redone": before - begin["step"],
                "conversion_s": converted[0] if converted else None}  # fmt: skip
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        (work / "output.log").write_text("".join(output.lines))
        if ray:
            ray.__exit__(None, None, None)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--launchers", nargs="+", default=list(LAUNCHERS), choices=LAUNCHERS)
    parser.add_argument("--work", default="runs/bench/elastic")
    harness.add_publish_arguments(parser, out=None, section="bench-elastic")
    args = parser.parse_args(argv)
    runs = []
    for repeat in range(args.repeats):
        for launcher in args.launchers:
            work = Path(args.work) / f"{launcher.split()[0].lower()}-{repeat}"
            runs.append(one_run(launcher, work, args.steps))
            print(json.dumps(runs[-1]), flush=True)
    rows = [[r["launcher"], r["cold_start_s"], r["restart_s"], r["to_training_s"], r["first_step_s"], r["ratio"],
             r["steps_redone"]] for r in runs]  # fmt: skip
    table = (
        harness.markdown_table(["launcher", "launch to first step (s)", "node lost to first step (s)",
                                "of which: to training again", "of which: first step", "restart / cold start",
                                "steps redone"], rows)
    )  # fmt: skip
    return harness.publish("benchmarks.bench_elastic", argv, [table], {"runs": runs}, args)


if __name__ == "__main__":
    main(sys.argv[1:])
