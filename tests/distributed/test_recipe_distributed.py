"""The recipe under every launcher: a real DeepSpeed ZeRO engine (or FSDP2) on 2 CPU ranks, training that learns,
output that loads, ranks that see different data, and the same result whichever 2-rank launcher started it; and the
same runs preempted by a real signal (to one rank, to torchrun, to DeepSpeed's launcher) and resumed.

The runs use the tiny BlenderBot with its dropout off, so that a run resumed on another number of ranks computes the
same function as the uninterrupted one.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest
import torch
from transformers import AutoTokenizer, BlenderbotForConditionalGeneration

from chat_e.data.samples import SAMPLE_CHATS
from hf_ext.exit_status import PREEMPTED_EXIT_CODE
from hf_ext.runtime import usable_cores
from hf_ext.saving.checkpoints import CHECKPOINT_MARKER
from hf_ext.saving.resume import FSDP_MODEL_DIR

from ..conftest import BIN, RECIPE, ROOT, TINY_YAML, TRAIN_LAUNCHER, free_port, launch_env, launcher_cmd, run

pytestmark = pytest.mark.distributed

#: every run's length: the issue's 30-step run
STEPS = 30

#: the sample replies are generated on rank 0 from the saved output, whichever engine trained it: asked of the
#: DeepSpeed-launcher and one-process runs only
NO_SAMPLES = ["--samples_to_print", "0"]
RUNS = {
    # name: (launcher, extra flags, expected world size, expected ZeRO stage or "fsdp")
    "deepspeed-zero2": ("deepspeed", [], 2, 2),  # no --deepspeed: the launcher implies hf-ext's zero2 preset
    # ZeRO-3 and FSDP2 with their ranks started as plain processes (tests/launched/ranks.py): the launchers are the
    # preempted runs' below (DeepSpeed's for ZeRO-3, accelerate's FSDP YAML, torchrun for ZeRO-2 and every resume),
    # whose every step has these runs' loss under the other launcher. accelerate's DeepSpeed YAML
    # (recipes/accelerate/zero2.yaml): the classification recipe's launch (tests/distributed/test_classification_recipe.py),
    # and under ZeRO-3 on two nodes the same weights as torchrun's (tests/distributed/test_multinode.py)
    "ranks-zero3": (TRAIN_LAUNCHER, ["--deepspeed", "zero3", *NO_SAMPLES], 2, 3),
    "ranks-fsdp": (TRAIN_LAUNCHER, ["--fsdp", "full_shard", *NO_SAMPLES], 2, "fsdp"),  # stock's flag
    "python": ("python", [], 1, None),
}


@pytest.fixture(scope="module")
def recipe_runs(tiny_model_no_dropout_dir, tmp_path_factory):
    """Each run happens once, on first use, and is shared by the tests below."""
    cache: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in cache:
            launcher, extra, _, _ = RUNS[name]
            out = tmp_path_factory.mktemp(name)
            cmd = launcher_cmd(launcher, RECIPE) + [
                "--config", str(TINY_YAML), "--model_name_or_path", str(tiny_model_no_dropout_dir), "--output_dir", str(out),
                "--max_steps", str(STEPS), "--samples_to_print", "2", "--logging_steps", "1", *extra,  # last: they win
            ]  # fmt: skip
            run(cmd)
            cache[name] = out
        return cache[name]

    return get


def load_results(out: Path) -> dict:
    return json.loads((out / "all_results.json").read_text())


def per_step_losses(out: Path) -> dict[int, float]:
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return {row["step"]: row["loss"] for row in history if "loss" in row}


def train_losses(out: Path) -> list[float]:
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [row["loss"] for row in history if "loss" in row]


@pytest.mark.parametrize("name", list(RUNS))
def test_recipe_trains_saves_and_reloads(name, recipe_runs, tiny_model_no_dropout_dir):
    out = recipe_runs(name)
    _, _, world_size, stage = RUNS[name]
    run_info = load_results(out)["run"]
    assert run_info["world_size"] == world_size
    if stage is None:
        assert run_info["engine"] != "DeepSpeedEngine"
    elif stage == "fsdp":  # read from the parameters: each rank holds half of each
        assert run_info["engine"] == "FSDP2"
        assert run_info["fsdp"] == {"sharding": "full_shard", "sharding_factor": 2, "replicas": 1}
    else:
        assert run_info["engine"] == "DeepSpeedEngine" and run_info["zero_stage"] == stage
        # hf-ext resolved the config under every launcher (accelerate's own YAML included): no "auto" reached DeepSpeed
        resolved = (out / "deepspeed_config.resolved.json").read_text()
        assert '"auto"' not in resolved and json.loads(resolved)["zero_optimization"]["stage"] == stage
    assert run_info["torch_threads"] == max(1, usable_cores() // world_size)

    losses = train_losses(out)
    assert len(losses) >= 3 and losses[-1] < losses[0]

    trained = BlenderbotForConditionalGeneration.from_pretrained(out)
    initial = BlenderbotForConditionalGeneration.from_pretrained(tiny_model_no_dropout_dir)
    trained_sd, initial_sd = trained.state_dict(), initial.state_dict()
    assert all(t.numel() > 0 for t in trained_sd.values())
    changed = [k for k in initial_sd if not torch.equal(initial_sd[k], trained_sd[k])]
    assert len(changed) > 0.8 * len(initial_sd)
    tok = AutoTokenizer.from_pretrained(out)
    reply = trained.generate(
        **tok(["Hello, how are you?"], return_tensors="pt"), max_new_tokens=8, min_length=2, num_beams=1
    )
    assert reply.shape[1] > 1
    assert (out / "training_curves.png").stat().st_size > 10_000
    samples = out / "sample_replies.json"
    if NO_SAMPLES[0] in RUNS[name][1]:
        assert not samples.exists()
    else:  # one opening message per Chat-E mode, then the --samples_to_print 2 validation contexts
        assert len(json.loads(samples.read_text())) == len(SAMPLE_CHATS) + 2


# --- preemption: real signals at step 8 of the 30-step runs above ----------------------------------------------------
#
# tests/launched/signal_at.py sends each signal from rank 1 at the end of step 8. Each engine is preempted twice, in
# two runs started side by side:
# - SIGTERM to the launcher (SLURM's and Kubernetes' route), which passes it on to every rank (torchrun and accelerate
#   at once; DeepSpeed's launcher one rank at a time) and exits with them: one checkpoint, every process gone within
#   a minute, and every step before it the uninterrupted run's. ``--resume_from_checkpoint True`` of it (on plain
#   ranks: the launcher is not this fact) then ends at the uninterrupted run's last step and weights.
# - SIGTERM to rank 1 alone, under torchrun's elastic agent (accelerate's for FSDP2's YAML) with one restart allowed
#   and ``--resume_from_checkpoint last`` (the launch docs/cluster.md gives): both ranks save checkpoint-9 and exit
#   75, the agent starts them again, and they resume from checkpoint-9 to the uninterrupted run's last step and
#   weights in the same launch.
# (DDP, ZeRO-1 and ZeRO-3 with offload: a signal to one rank, its checkpoint and its resume in-process, in the engine
# oracle's launch, tests/distributed/test_engines.py.)
# name: (the uninterrupted run it must end as, engine flags, launcher of the first run, elastic launcher, engine flags
# on plain ranks, where accelerate's YAML gave the engine). The first
# runs start under another launcher than their oracle: torchrun's ZeRO-2 against DeepSpeed's launcher, DeepSpeed's
# launcher's ZeRO-3 and accelerate's FSDP YAML against plain ranks (--fsdp); their steps before the signal then show
# that the launcher does not change the run.
ACCELERATE_FSDP = f"accelerate:{ROOT / 'recipes/accelerate/fsdp.yaml'}"
PREEMPTIONS = {
    "zero2-under-torchrun": ("deepspeed-zero2", ["--deepspeed", "zero2"], "torchrun", "torchrun", []),
    "zero3-under-deepspeeds-launcher": ("ranks-zero3", ["--deepspeed", "zero3"], "deepspeed", "torchrun", []),
    "fsdp2-under-accelerate": ("ranks-fsdp", [], ACCELERATE_FSDP, ACCELERATE_FSDP, ["--fsdp", "full_shard"]),
}  # fmt: skip
SIGNAL_STEP = 8
# Tolerance of the resumed weights against the uninterrupted run's: a resume on the same ranks repeats the same
# arithmetic (measured 0 apart). A resume on 1 rank of a 2-rank checkpoint (tests/distributed/test_multinode.py, the
# Ray test below) sums each step's gradient in another order (accumulation instead of the all-reduce) and pads its
# micro-batches to other shapes; after 22 Adam steps the weights were 1.0e-6 apart at most, where the 30 steps move
# them by 1.6e-2. 1e-5 (the bound) is 10x that measurement.
RESUME_TOLERANCE = 1e-5


def signal_sent(log: str, target: str) -> float:
    """When rank 1 sent SIGTERM to ``target`` at the end of step 8 (the line signal_at.py prints)."""
    sent = re.search(rf"rank 1: SIGTERM to {target} \(pid \d+\) at step {SIGNAL_STEP} at ([\d.]+)", log)
    assert sent, log[-4000:]
    return float(sent.group(1))


def checkpoints(out: Path) -> list[str]:
    return sorted((p.name for p in out.iterdir() if "checkpoint" in p.name), key=lambda n: int(n.split("-")[-1]))


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "model.safetensors")


def assert_preempted(log: str, step: int) -> None:
    """Every rank agreed on ``step`` and saved it; rank 0 said so and how to resume."""
    assert "SIGTERM reached rank" in log and f"every rank saves checkpoint-{step} and stops" in log, log[-4000:]
    assert f"Preempted (SIGTERM): checkpoint-{step} is saved" in log


def assert_ends_as(out: Path, oracle: Path) -> None:
    """The run in ``out`` logged the uninterrupted run's loss at each of its steps and ended at its weights."""
    assert per_step_losses(out) == pytest.approx(per_step_losses(oracle), rel=1e-6)
    assert sorted(per_step_losses(out)) == list(range(1, STEPS + 1))
    expected, got = final_weights(oracle), final_weights(out)
    assert expected.keys() == got.keys()
    assert max((expected[k] - got[k]).abs().max().item() for k in expected) <= RESUME_TOLERANCE


def launch(cmd: list[str], env: dict) -> tuple[subprocess.CompletedProcess, float]:
    """``cmd`` run to its end with ``env`` added, output captured, not checked; and the time it exited."""
    proc = subprocess.run(cmd, cwd=ROOT, env=launch_env(**env), capture_output=True, text=True, timeout=600)
    return proc, time.time()


@pytest.fixture(scope="module")
def preempted_runs(tmp_path_factory, tiny_model_no_dropout_dir):
    """Each engine's two preempted runs (signal to the launcher, signal to one worker), started side by side once and
    shared by the tests below; as soon as the first has exited, ``--resume_from_checkpoint True`` of its checkpoint
    (on plain ranks: the launcher is not this fact) runs beside the second. ``{"launcher": (out, log, exit status,
    seconds from signal to exit), "resumed": the resume's result, "worker": (out, log, exit status)}``; the worker
    run's ranks write their milestones to ``worker.clock`` beside its output (tests/launched/step_clock.py)."""
    cache: dict[str, dict] = {}

    def get(name: str) -> dict:
        if name not in cache:
            _, flags, first, elastic, plain = PREEMPTIONS[name]
            root = tmp_path_factory.mktemp(name)

            def args(out: Path) -> list[str]:
                return ["--config", str(TINY_YAML), "--model_name_or_path", str(tiny_model_no_dropout_dir),
                        "--output_dir", str(out), "--max_steps", str(STEPS), "--samples_to_print", "0",
                        "--do_eval", "false", "--logging_steps", "1", *flags]  # fmt: skip

            # torchrun and accelerate are started as most launches are, with their own rendezvous, and allowed a
            # restart: hf-ext says that a restarted group could not reconnect through it
            restarts = {} if first == "deepspeed" else {"max_restarts": 1, "store_per_attempt": False}

            def signalled_then_resumed():
                # as a scheduler runs it: hf-ext launch in front of the launch line, the signal to that command
                signalled = launch([str(BIN / "hf-ext"), "launch", *launcher_cmd(first, RECIPE, **restarts),
                                    *args(root / "launcher")],
                                   {"HF_EXT_TEST_SIGNAL_AT": f"{SIGNAL_STEP}:SIGTERM:command"})  # fmt: skip
                resume = launcher_cmd(TRAIN_LAUNCHER, RECIPE) + args(root / "launcher") + plain
                return signalled, launch(resume + ["--resume_from_checkpoint", "True"], {})[0]

            with ThreadPoolExecutor(max_workers=2) as pool:
                to_launcher = pool.submit(signalled_then_resumed)
                to_worker = pool.submit(launch, [str(BIN / "hf-ext"), "launch", *launcher_cmd(elastic, RECIPE,
                                        max_restarts=1), *args(root / "worker"), "--resume_from_checkpoint", "last"],
                                        {"HF_EXT_TEST_SIGNAL_AT": f"{SIGNAL_STEP}:SIGTERM:self",
                                         "HF_EXT_TEST_CLOCK": str(root / "worker.clock")})  # fmt: skip
                (signalled, ended), resumed = to_launcher.result()
                worker = to_worker.result()[0]
            log = signalled.stdout + signalled.stderr
            cache[name] = {
                "launcher": (root / "launcher", log, signalled.returncode, ended - signal_sent(log, "command")),
                "resumed": resumed, "worker": (root / "worker", worker.stdout + worker.stderr, worker.returncode),
                "first": first, "restarts": bool(restarts),
            }  # fmt: skip
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(PREEMPTIONS))
def test_sigterm_to_the_launcher_saves_exits_and_resumes_to_the_uninterrupted_weights(name, preempted_runs,
                                                                                      recipe_runs):  # fmt: skip
    runs = preempted_runs(name)
    out, log, status, seconds = runs["launcher"]
    oracle = recipe_runs(PREEMPTIONS[name][0])
    assert ("restarts failed workers (up to 1 times)" in log) == runs["restarts"], log[-4000:]
    # one checkpoint, atomically saved, at the step the ranks agreed on: through the launcher the signal reaches them
    # after step 8
    saved = checkpoints(out)
    assert len(saved) == 1 and re.fullmatch(r"checkpoint-\d+", saved[0]), (saved, log[-4000:])
    step = int(saved[0].split("-")[1])
    assert SIGNAL_STEP < step < STEPS
    assert_preempted(log, step)
    # the command's status is the ranks' (the launcher's own is 1 under torchrun), with one line and no traceback
    assert status == PREEMPTED_EXIT_CODE, log[-4000:]
    assert f"hf-ext launch: preempted (SIGTERM): {out / saved[0]} is saved; exit status 75" in log
    assert "Traceback" not in log, log[-4000:]
    # every process exited, within a minute of the signal
    assert seconds < 60
    assert not [p.pid for p in psutil.process_iter(["cmdline"]) if str(out) in " ".join(p.info["cmdline"] or [])]
    if runs["first"] == ACCELERATE_FSDP:  # accelerate's YAML ran FSDP2 on 2 ranks: each wrote its own shard
        checkpoint = out / saved[0]
        assert json.loads((checkpoint / CHECKPOINT_MARKER).read_text())["world_size"] == 2
        assert sorted(p.name for p in (checkpoint / FSDP_MODEL_DIR).glob("*.distcp")) == [
            "__0_0.distcp",
            "__1_0.distcp",
        ]
    # every step before the checkpoint has the uninterrupted run's loss
    before = per_step_losses(out / saved[0])
    assert sorted(before) == list(range(1, step + 1))
    assert before == pytest.approx({k: v for k, v in per_step_losses(oracle).items() if k in before}, rel=1e-6)

    # --resume_from_checkpoint True of it
    resumed = runs["resumed"]
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-4000:]
    assert checkpoints(out) == saved
    assert_ends_as(out, oracle)


@pytest.mark.parametrize("name", list(PREEMPTIONS))
def test_sigterm_to_one_worker_saves_and_the_restarted_workers_resume_to_the_uninterrupted_weights(name,
                                                                                                   preempted_runs,
                                                                                                   recipe_runs):  # fmt: skip
    out, log, status = preempted_runs(name)["worker"]
    assert status == 0, log[-4000:]  # the restarted workers finished the run
    assert "resume_from_checkpoint='last': no checkpoint" in log  # the first workers started from scratch
    assert_preempted(log, SIGNAL_STEP + 1)  # the signal reached its rank at the end of step 8: the ranks agreed at 9
    assert checkpoints(out) == [f"checkpoint-{SIGNAL_STEP + 1}"]
    # the first workers (the two that ran step 8) exited after checkpoint-9, within a minute of the signal
    clock = [json.loads(line) for line in (out.parent / "worker.clock").read_text().splitlines()]
    first = {e["pid"] for e in clock if e["event"] == "step" and e["step"] == SIGNAL_STEP}
    exits = {e["pid"]: e for e in clock if e["event"] == "exit" and e["pid"] in first}
    assert len(first) == 2 and exits.keys() == first, clock
    assert {e["step"] for e in exits.values()} == {SIGNAL_STEP + 1}
    assert max(e["time"] for e in exits.values()) - signal_sent(log, "self") < 60
    # the workers that exited after checkpoint-9 were started again in the same launch; with a store per attempt
    # hf-ext has nothing to say of the restart
    assert "restarts failed workers" not in log
    # both ranks exited on their own: the agent did not have to kill one (it SIGKILLs a worker that outlives its
    # SIGTERM by 30 s)
    assert "forcefully exiting" not in log
    assert_ends_as(out, recipe_runs(PREEMPTIONS[name][0]))


# --- Ray Train as the launcher: a local cluster of two nodes (two raylets on this host, one CPU each) ---------------
#: the Ray nodes' temporary folder: a tmpfs, another filesystem than the test's output
NODE_TMP = Path("/dev/shm")


@pytest.fixture(scope="module")
def ray_cluster(tmp_path_factory):
    """A real Ray cluster: a head and a second node, started with ``ray start`` on loopback (token authentication off,
    as on a private network), one CPU each so that each Ray Train worker lands on its own node. A node that stops
    answering is declared dead after 3 health checks 0.5 s apart (Ray's default: 5 of 3 s). A worker group whose
    placement group is not ready within 5 s (Ray's default: 60 s) is given up and retried at the size the cluster then
    has: after a node is lost, Ray's view of the cluster's resources is refreshed every 20 s, so its first restart asks
    for the 2 workers it had and waits this long for them. A placement group on free CPUs is ready at once."""
    # the nodes' temporary folder on another filesystem than the output (a tmpfs, as a cluster's node-local /tmp is
    # beside its shared storage); Ray's own session files stay where they were
    env = launch_env(RAY_AUTH_MODE="disabled", RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S="5", TMPDIR=str(NODE_TMP),
                     RAY_TMPDIR=tempfile.gettempdir())  # fmt: skip
    port = free_port()
    system = json.dumps({"health_check_period_ms": 500, "health_check_failure_threshold": 3,
                         "health_check_initial_delay_ms": 0})  # fmt: skip
    raylets = []
    for role in (["--head", "--port", str(port), "--include-dashboard", "false", f"--system-config={system}"],
                 ["--address", f"127.0.0.1:{port}"]):  # fmt: skip
        before = {p.pid for p in psutil.process_iter(["name"]) if p.info["name"] == "raylet"}
        subprocess.run([str(BIN / "ray"), "start", *role, "--num-cpus", "1", "--disable-usage-stats"], env=env,
                       check=True, capture_output=True, timeout=120)  # fmt: skip
        raylets.append(next(p for p in psutil.process_iter(["name"]) if p.info["name"] == "raylet"
                            and p.pid not in before))  # fmt: skip
    env["RAY_ADDRESS"] = f"127.0.0.1:{port}"
    yield {"env": env, "second_node": raylets[1]}
    subprocess.run([str(BIN / "ray"), "stop", "--force"], env=env, capture_output=True, timeout=120)


def ray_recipe(ray_cluster, model_dir: Path, out: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, str(RECIPE), "--config", str(TINY_YAML), "--model_name_or_path", str(model_dir),
           "--output_dir", str(out), "--max_steps", str(STEPS), "--samples_to_print", "0", "--do_eval", "false",
           "--deepspeed", "zero2", "--launcher", "ray", "--ray_storage", str(out.parent / f"{out.name}.ray"), *extra]  # fmt: skip
    log = out.parent / f"{out.name}.log"
    return subprocess.Popen(cmd, cwd=ROOT, env=ray_cluster["env"], stdout=log.open("w"), stderr=subprocess.STDOUT)


def test_ray_elastic_loses_a_node_and_resumes_on_one_worker(ray_cluster, recipe_runs, tiny_model_no_dropout_dir,
                                                            tmp_path):  # fmt: skip
    out = tmp_path / "elastic"
    assert os.stat(tmp_path).st_dev != os.stat(NODE_TMP).st_dev  # the premise: checkpoints cross no device
    proc = ray_recipe(ray_cluster, tiny_model_no_dropout_dir, out, "--num_workers", "1:2", "--max_failures", "1",
                      "--save_strategy", "steps", "--save_steps", "8", "--resume_from_checkpoint", "last",
                      "--logging_steps", "1")  # fmt: skip
    deadline = time.monotonic() + 300
    rank1 = "checkpoint-8/global_step8/zero_pp_rank_1_mp_rank_00_optim_states.pt"
    while not list((out.parent / "elastic.ray").glob(f"*/{rank1}")):  # both ranks reported checkpoint-8 to Ray
        assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "elastic.log").read_text()[-4000:]
        time.sleep(0.02)
    node = ray_cluster["second_node"]  # the second machine goes away: its raylet and its worker
    for process in [node, *node.children(recursive=True)]:
        process.kill()
    assert proc.wait(timeout=600) == 0, (tmp_path / "elastic.log").read_text()[-4000:]
    log = (tmp_path / "elastic.log").read_text()
    assert "Started training worker group of size 2" in log and "Started training worker group of size 1" in log
    assert "Resuming checkpoint-8 (written on 2 ranks) on 1" in log
    # the tokenization's function is not disassembled into the log: datasets fingerprints a closure with dill, which
    # prints its bytecode into a captured stdout, and Ray Train's print patch logs captured prints too
    assert "(tokenizer)" not in log and "encode_example)" not in log
    assert load_results(out)["run"]["launcher"] == "ray" and load_results(out)["run"]["world_size"] == 1
    # steps 1-8 on 2 Ray workers, 9-30 on 1: DeepSpeed's launcher's 2-rank losses at every step, its final weights
    oracle = recipe_runs("deepspeed-zero2")
    assert per_step_losses(out) == pytest.approx(per_step_losses(oracle), rel=1e-6)
    assert sorted(per_step_losses(out)) == list(range(1, STEPS + 1))
    expected, got = final_weights(oracle), final_weights(out)
    assert max((expected[k] - got[k]).abs().max().item() for k in expected) <= RESUME_TOLERANCE
    # Ray's checkpoint-8 holds both ranks' files, each reported by the rank that wrote it (merged by Ray)
    reported = next((out.parent / "elastic.ray").glob("*/checkpoint-8"))
    local = out / "checkpoint-8"
    assert sorted(str(p.relative_to(local)) for p in local.rglob("*") if p.is_file()) == sorted(
        str(p.relative_to(reported)) for p in reported.rglob("*") if p.is_file())  # fmt: skip
    assert {p.name for p in reported.rglob("*zero_pp_rank_*optim_states.pt")} == {
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in (0, 1)}  # fmt: skip


def training_rows(config: Path, model_dir: Path, **overrides):
    """The recipe's tokenized training rows for a YAML ``config`` and CLI ``overrides`` (its data pipeline alone)."""
    import dataclasses

    import yaml

    from chat_e.data.corpora import DataArguments, load_dialogue_dataset, tokenize_dataset

    names = {f.name for f in dataclasses.fields(DataArguments)}
    data_args = DataArguments(**{**{k: v for k, v in yaml.safe_load(config.read_text()).items() if k in names},
                                 **overrides})  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return tokenize_dataset(load_dialogue_dataset(data_args)["train"], tokenizer, data_args, family="causal")


def test_recipe_fine_tunes_a_decoder_only_chat_model_with_lora(tmp_path):
    """The demo's path at test scale: a chat model built on first use (chat-tiny), LoRA, ZeRO-2 on 2 ranks, chitchat +
    chatterbot, BLEU before (eval_on_start) and after, the adapter beside the merged model, base-vs-tuned replies."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir, out, config = tmp_path / "chat-tiny", tmp_path / "out", ROOT / "recipes" / "configs" / "demo.yaml"
    proc = run(launcher_cmd(TRAIN_LAUNCHER, RECIPE) + [
        "--config", str(config), "--model_name_or_path", str(model_dir),
        "--build_model", "chat-tiny", "--output_dir", str(out), "--n_train", "48", "--n_val", "8", "--max_steps", "6",
        "--eval_steps", "6", "--logging_steps", "1", "--samples_to_print", "1", "--learning_rate", "0.01",
    ])  # fmt: skip
    assert "Model family: causal" in proc.stderr + proc.stdout
    # padding-free by default, and its count of real tokens: 6 steps x 8 rows are the 48 training rows, once each
    assert "Batches: padding-free, sampler batch_rebalance" in proc.stderr
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["num_input_tokens_seen"] == sum(
        len(ids) for ids in training_rows(config, model_dir, n_train=48, n_val=8)["input_ids"]
    )
    assert "before fine-tuning: BLEU" in proc.stdout and "after fine-tuning:  BLEU" in proc.stdout
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert [e["step"] for e in history if "eval_bleu" in e] == [0, 6]  # the base model, then the tuned one
    results = load_results(out)
    assert results["run"]["engine"] == "DeepSpeedEngine" and results["run"]["zero_stage"] == 2
    assert "eval_bleu" in results and "eval_chrf" in results and results["eval_loss"] > 0
    assert results["train_tokens_per_second"] > results["train_samples_per_second"] > 0
    # the adapter, and the merged model: the base with that adapter merged, as peft merges it
    assert (out / "adapter" / "adapter_config.json").is_file()
    merged = AutoModelForCausalLM.from_pretrained(out)
    expected = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), out / "adapter")
    expected = expected.merge_and_unload().state_dict()
    assert merged.state_dict().keys() == expected.keys()
    assert all(torch.allclose(v, expected[k], atol=1e-6) for k, v in merged.state_dict().items())
    base = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    assert not torch.equal(
        base["model.layers.0.self_attn.q_proj.weight"], expected["model.layers.0.self_attn.q_proj.weight"]
    )
    assert AutoTokenizer.from_pretrained(out).chat_template  # Chat-E can render its prompts
    samples = json.loads((out / "sample_replies.json").read_text())
    assert len(samples) == 6 and all({"base", "tuned"} <= set(s) for s in samples)
    assert [s["mode"] for s in samples[:5]] == ["persona", "emotion", "domain", "topic", "free"]
