"""Training runs started from the app: the feedback exported, ``chat-e train`` started as its own process group with
its log on disk, its progress read back, cancelled with a checkpoint and resumed, and every run a record in the
feedback database (:class:`chat_e.feedback.store.TrainingRun`).

* **Start** exports the database's rows of the run's method (:data:`METHOD_RUNS`: DPO pairs, KTO labels, or DPO
  pairs for SFT on their chosen replies; KTO labels for KTO+SFT) into the run's folder, then
  starts ``chat-e train`` (:mod:`chat_e.training.launch`) under ``nice`` (the ranks inherit it), in a new session
  (so that it outlives a restarted server), with ``CHAT_E_PROGRESS_FILE`` set (:mod:`chat_e.training.progress`). One run at a
  time: a second Start while one runs is refused in one line.
* **Cancel** sends SIGTERM to the run's ranks (not to its launcher, which would kill them 30 s later): hf-ext's preemption (``save_on_preemption``) has every rank save one
  checkpoint at the next step boundary and exit with status 75; the run is then ``stopped``. **Resume** starts the
  same command with ``--resume_from_checkpoint True``.
* **Eval**: once a run is done (the newest done run, one at a time), ``chat-e eval`` (:mod:`chat_e.training.evaluate`) compares its model with the model
  it was trained from (the served one when it started), niced like the training, its report in the run's folder
  (``eval/eval.json``, ``eval/eval.md``, ``eval/eval.png``). Promote asks for confirmation while that report is
  missing or says the run's model is worse beyond the 95 % interval on any score (:meth:`RunManager.promotion_doubt`).
* **Refresh** decides what a ``running`` record is now: its process still running (the pid *and* the process's start
  time, so that a later process given the same pid is not taken for it); else, from the exit status where this
  manager started the process, or from what the run left where another (an app restarted mid-run) did: the training's
  report (done), a preemption checkpoint (stopped), anything else failed with the log's last lines. A run is never
  left ``running`` once its process is gone.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from hf_ext.atomic import write_text_atomically
from hf_ext.deepspeed.load import PRESETS
from hf_ext.exit_status import PREEMPTED_EXIT_CODE, RECORD_ENV, read_preemption_record

from ..data.stats import Share
from ..feedback.export import export
from ..feedback.store import (
    ACTIVE_STATES,
    CANCELLED,
    CANCELLING,
    DONE,
    FAILED,
    QUEUED,
    RUNNING,
    STOPPED,
    FeedbackStore,
    utcnow,
)
from ..training.eval_cli import command as eval_command
from ..training.launch import (
    LAUNCHERS,
    PREFERENCE_REPORT,
    PREFERRED_PER_TOKEN,
    PREFERRED_SUM,
    REPLY_NLL,
    STOP_MARK,
    command,
    replay_problem,
)
from ..training.progress import ENV as PROGRESS_ENV
from ..training.progress import NICENESS_ENV, PREPARING, TRAINING, read_progress

logger = logging.getLogger(__name__)

#: the held-out scores a done run shows, before → after (the training's report: chat_e.training.heldout)
HEADLINE = ((PREFERRED_SUM, "prefers chosen"), (PREFERRED_PER_TOKEN, "per token"))


def share_text(value: dict | None) -> str:
    """A reported share (:meth:`chat_e.data.stats.Share.as_dict`) as text: rate, 95 % interval and counts."""
    return Share(**value).text() if value else "—"


def held_out_line(before: dict, after: dict) -> str:
    """A done run's held-out scores, before → after: the model's own preference for the chosen (desirable) reply,
    summed and per token, each with its 95 % interval and counts, and the preferred replies' NLL per token."""
    shown = [f"{label} {share_text(before.get(key))} → {share_text(after.get(key))}" for key, label in HEADLINE]
    nll_before, nll_after = before.get(REPLY_NLL), after.get(REPLY_NLL)
    if nll_after is not None:
        was = "—" if nll_before is None else f"{nll_before:.3f}"
        shown.append(f"preferred reply NLL/token {was} → {nll_after:.3f}")
    return f"Held-out ({after.get('rows', 0)} rows; {after.get('pairing', 'pairs')}): " + "; ".join(shown)


#: the methods the app trains from its feedback: each one's rows (a chat_e.feedback.export format), its ``chat-e
#: train`` method and the flags it adds. SFT learns the chosen reply of each pair (corrections, choices after
#: Regenerate, arena winners) with TRL's DPO trainer and its ``sft`` loss, so that it holds out the same sessions
#: and reports the same before/after as DPO (the model's own preference on held-out pairs). SFT on every endorsed
#: reply, thumbs up included, is the dialogue recipe's: ``chat-e feedback export --format sft``. KTO+SFT is KTO's
#: loss plus the desirable replies' NLL per token (hf_ext.trl.KTOConfig's ``sft_weight``), so that replayed rows
#: keep their likelihood, which KTO's loss alone does not ask (docs/benchmarks.md, "What the loop buys"); its weight
#: is the form's ``sft_weight``.
METHOD_RUNS = {
    "dpo": ("dpo", "dpo", []),
    "kto": ("kto", "kto", []),
    "sft": ("dpo", "dpo", ["--loss_type", "sft"]),
    "kto+sft": ("kto", "kto", []),
}
#: the method whose loss has the form's SFT weight
SFT_TERM_METHOD = "kto+sft"
APP_METHODS = tuple(METHOD_RUNS)
#: the preemption's record a run's rank 0 writes in the run's folder (hf_ext.exit_status)
PREEMPTION_RECORD = "preempted.json"
#: how nice the training runs (its launcher, and each rank's session), so that chat stays responsive on a small
#: machine (docs/benchmarks.md, "Chat-E's fine-tune loop")
NICENESS = 10
LOG_TAIL_LINES = 20
#: the line the manager writes into a run's log before each launch (start, resume)
LAUNCH_MARK = "=== chat-e: launch of run"
MAX_STEPS = 100_000
#: a run's eval report (chat-e eval's output dir in the run's folder) and its log
EVAL_DIR, EVAL_LOG, EVAL_PID = "eval", "eval.log", "eval.pid"


@dataclass
class RunForm:
    """What the operator chooses for a run; the base model is the served one."""

    method: str = "dpo"
    max_steps: int = 20
    #: LoRA rank; 0 trains every weight. The defaults are an adapter and its learning rate: a 135M model's every
    #: weight at 1e-3 forgets what it knew in a few steps
    lora_rank: int = 16
    learning_rate: float = 5e-4
    launcher: str = "python"
    nproc: int = 1
    #: a DeepSpeed preset name (zero2, zero3...), or none
    preset: str = "none"
    #: rows held out for the before/after (whole sessions, so about this many; at most half of the rows)
    held_out: int = 16
    #: rows per rank and step (training), and twice as many in the evaluations
    batch: int = 4
    #: tokens of prompt and reply kept (TRL's max_length; a row whose prompt alone fills it is dropped)
    max_length: int = 256
    #: rows of make demo's corpus (human chit-chat) trained on beside the feedback, so that the model keeps what it
    #: knew (rehearsal); 0: the feedback alone
    replay: int = 0
    #: kto+sft's SFT term: KTO's loss plus this times the desirable replies' NLL per token (other methods: unused)
    sft_weight: float = 1.0

    def check(self) -> None:
        """A ``ValueError`` naming the first bad value and a fix, before anything starts."""
        if self.method not in APP_METHODS:
            raise ValueError(f"method={self.method!r}: choose one of {', '.join(APP_METHODS)}.")
        if not isinstance(self.max_steps, int) or not 1 <= self.max_steps <= MAX_STEPS:
            raise ValueError(f"steps={self.max_steps!r}: choose a whole number from 1 to {MAX_STEPS:,}.")
        if not isinstance(self.lora_rank, int) or not 0 <= self.lora_rank <= 1024:
            raise ValueError(f"LoRA rank={self.lora_rank!r}: choose 0 (every weight) to 1024.")
        if not 0 < float(self.learning_rate) <= 1:
            raise ValueError(f"learning rate={self.learning_rate!r}: choose a number above 0 and at most 1.")
        if not 0 < float(self.sft_weight) <= 100:
            raise ValueError(f"SFT weight={self.sft_weight!r}: choose a number above 0 and at most 100.")
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"launcher={self.launcher!r}: choose one of {', '.join(LAUNCHERS)}.")
        cores = os.cpu_count() or 1
        if not isinstance(self.nproc, int) or not 1 <= self.nproc <= cores:
            raise ValueError(f"ranks={self.nproc!r}: choose 1 to {cores} on this machine.")
        if self.launcher == "python" and self.nproc != 1:
            raise ValueError("The python launcher starts one rank: choose 1 rank, or torchrun / deepspeed.")
        for name, value, low, high in (
            ("held-out rows", self.held_out, 1, 1024),
            ("batch", self.batch, 1, 64),
            ("max length", self.max_length, 32, 8192),
            ("replay rows", self.replay, 0, 4096),
        ):
            if not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name}={value!r}: choose a whole number from {low} to {high}.")
        if self.preset not in ("none", *PRESETS):
            raise ValueError(f"preset={self.preset!r}: choose none or one of {', '.join(PRESETS)}.")
        _, _, flags = METHOD_RUNS[self.method]
        loss_types = flags[flags.index("--loss_type") + 1 :] if "--loss_type" in flags else ["sigmoid"]
        if problem := replay_problem(METHOD_RUNS[self.method][0], loss_types, self.replay):
            raise ValueError(problem)
        if self.preset != "none" and self.launcher == "python":
            raise ValueError(f"preset={self.preset!r} needs a distributed launcher: choose torchrun or deepspeed.")


def method_rows(method: str) -> str:
    """What the app's ``method`` trains on, in words: "DPO rows", "KTO rows", "SFT rows (the chosen reply of each DPO
    pair)"."""
    rows_format = METHOD_RUNS[method][1]
    return f"{method.upper()} rows" + (
        f" (the chosen reply of each {rows_format.upper()} pair)" if rows_format != method.split("+")[0] else ""
    )


class RunManager:
    """Runs of ``chat-e train`` on ``base_model``, recorded in ``store``, each in a folder of ``run_dir``.
    ``train_args`` go before the form's flags (a ``--config`` YAML, say)."""

    def __init__(
        self,
        store: FeedbackStore,
        base_model: str,
        run_dir: str | Path,
        train_args: list[str] = (),
        eval_args: list[str] = (),
    ):
        self.store, self.base_model, self.run_dir = store, str(base_model), Path(run_dir)
        self.train_args, self.eval_args = list(train_args), list(eval_args)
        #: how nice the runs are (NICENESS; 0 leaves their priority as the server's)
        self.niceness = NICENESS
        self._procs: dict[int, subprocess.Popen] = {}
        self._evals: dict[int, subprocess.Popen] = {}

    # ---- starting --------------------------------------------------------------------------------------------

    def start(self, form: RunForm) -> int:
        """Check ``form``, export the rows, record the run and start it; its id. ``ValueError``: one line saying
        what is wrong (the form, no rows, a run already running)."""
        form.check()
        self._refuse_if_running()
        feedback, votes = self.store.feedback(), self.store.votes()
        folder = self.run_dir / f"run-{utcnow():%Y%m%d-%H%M%S-%f}"
        folder.mkdir(parents=True)
        trainer, rows_format, flags = METHOD_RUNS[form.method]
        rows_file = folder / f"{rows_format}.jsonl"
        count, unused = export(feedback, votes, rows_format, rows_file)
        if count == 0:
            shutil.rmtree(folder, ignore_errors=True)
            reasons = ", ".join(f"{n} {why}" for why, n in unused.most_common()) or "no feedback yet"
            raise ValueError(f"The database has no {method_rows(form.method)} yet ({reasons}): collect more feedback.")
        args = [*self._training_args(form, rows_file, folder / "out"), *flags]
        cmd = command(trainer, form.launcher, form.nproc, args)
        run_id = self.store.add_run(
            method=form.method,
            settings={"form": asdict(form), "command": cmd, "base_model": self.base_model},
            rows=count,
            rows_sha256=hashlib.sha256(rows_file.read_bytes()).hexdigest(),
            status=QUEUED,
            output_dir=str(folder / "out"),
            log_path=str(folder / "train.log"),
        )
        self._launch(run_id, cmd)
        return run_id

    def resume(self, run_id: int) -> None:
        """Start stopped run ``run_id`` again from its checkpoint."""
        run = self._get(run_id)
        if run["status"] != STOPPED:
            raise ValueError(f"Run #{run_id} is {run['status']}: only a stopped run resumes.")
        self._refuse_if_running()
        self._launch(run_id, [*run["settings"]["command"], "--resume_from_checkpoint", "True"])
        logger.info("run #%d resumed from its checkpoint", run_id)

    def cancel(self, run_id: int) -> None:
        """Ask running run ``run_id`` to save a checkpoint and stop: the run is ``cancelling`` until its process ends,
        and SIGTERM goes to its ranks (:func:`signal_ranks`) once. A second Cancel sends nothing (hf-ext's
        preemption takes a second signal as "exit now", which would lose the checkpoint being saved)."""
        run = self._get(run_id)
        if run["status"] == CANCELLING:
            raise ValueError(f"Run #{run_id} is cancelling already: it saves a checkpoint and stops.")
        if run["status"] != RUNNING or not self._alive(run):
            raise ValueError(f"Run #{run_id} is not running.")
        self.store.update_run(run_id, status=CANCELLING)
        logger.info("run #%d: cancel requested (SIGTERM to its ranks)", run_id)
        signal_ranks(run["pid"], signal.SIGTERM)

    def _training_args(self, form: RunForm, rows_file: Path, out: Path) -> list[str]:
        # activation checkpointing off unless train_args turn it on (TRL's default is on: slower, and a chat model the
        # app serves on a CPU fits without it)
        args = [
            "--gradient_checkpointing",
            "false",
            *self.train_args,
            "--model_name_or_path",
            self.base_model,
            "--data_file",
            str(rows_file),
            "--output_dir",
            str(out),
            "--max_steps",
            str(form.max_steps),
            "--learning_rate",
            str(form.learning_rate),
            "--n_eval",
            str(form.held_out),
            "--per_device_train_batch_size",
            str(form.batch),
            "--per_device_eval_batch_size",
            str(2 * form.batch),
            "--max_length",
            str(form.max_length),
            "--logging_steps",
            "1",
            "--save_strategy",
            "no",
            "--report_to",
            "none",
        ]
        if form.lora_rank:
            args += ["--use_peft", "true", "--lora_r", str(form.lora_rank), "--lora_alpha", str(2 * form.lora_rank)]
        if form.preset != "none":
            args += ["--deepspeed", form.preset]
        if form.replay:
            args += ["--replay", str(form.replay)]
        if form.method == SFT_TERM_METHOD:
            args += ["--sft_weight", f"{float(form.sft_weight):g}"]
        return args

    def _niced(self) -> list[str]:
        nice = shutil.which("nice")
        return [nice, "-n", str(self.niceness)] if nice and self.niceness else []

    def _launch(self, run_id: int, cmd: list[str]) -> None:
        run = self._get(run_id)
        folder = Path(run["log_path"]).parent
        niced = self._niced()
        # each rank gives its own session the same niceness (chat_e.training.progress says why)
        (folder / PREEMPTION_RECORD).unlink(missing_ok=True)  # an earlier launch's (this one may resume it)
        env = {
            **os.environ,
            PROGRESS_ENV: str(folder / "progress.jsonl"),
            NICENESS_ENV: str(self.niceness),
            RECORD_ENV: str(folder / PREEMPTION_RECORD),
        }
        with open(run["log_path"], "ab") as log:
            log.write(f"{LAUNCH_MARK} #{run_id} at {utcnow():%Y-%m-%d %H:%M:%S} UTC: {' '.join(cmd)}\n".encode())
            log.flush()
            proc = subprocess.Popen(
                [*niced, *cmd], stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self._procs[run_id] = proc
        started = psutil.Process(proc.pid).create_time()
        self.store.update_run(
            run_id,
            status=RUNNING,
            pid=proc.pid,
            pid_started=started,
            ended_at=None,
            started_at=run["started_at"] or utcnow(),
            detail=None,
        )

    def _refuse_if_running(self) -> None:
        running = [r for r in self.refresh() if r["status"] in ACTIVE_STATES]
        if running:
            raise ValueError(f"Run #{running[0]['id']} is running: cancel it or wait for it to end (one at a time).")

    def _get(self, run_id: int) -> dict[str, Any]:
        run = self.store.run(run_id)
        if run is None:
            raise ValueError(f"There is no run #{run_id}.")
        return run

    # ---- watching --------------------------------------------------------------------------------------------

    @staticmethod
    def _alive(run: dict[str, Any]) -> bool:
        """Whether ``run``'s process is still the one it started (same pid and start time), and not a zombie."""
        try:
            process = psutil.Process(run["pid"])
            return (
                abs(process.create_time() - (run["pid_started"] or 0)) < 0.01
                and process.status() != psutil.STATUS_ZOMBIE
            )
        except (psutil.NoSuchProcess, TypeError, ValueError):
            return False

    def refresh(self) -> list[dict[str, Any]]:
        """Settle every ``running`` record whose process ended; every run, newest first."""
        for run in self.store.runs():
            if run["status"] not in ACTIVE_STATES:
                continue
            proc = self._procs.get(run["id"])
            code = proc.poll() if proc is not None else None
            if proc is not None and code is None or proc is None and self._alive(run):
                continue
            self._procs.pop(run["id"], None)
            self._settle(run, code)
        runs = self.store.runs()
        done = next((r for r in runs if r["status"] == DONE), None)  # the newest done run: one eval at a time
        if done and not (Path(done["log_path"]).parent / EVAL_LOG).exists():
            self._start_eval(done)
        return runs

    # ---- the eval of a done run --------------------------------------------------------------------------------

    def _start_eval(self, run: dict[str, Any]) -> None:
        """``chat-e eval`` of run ``run``'s model beside the model it was trained from, niced, logged beside it."""
        folder = Path(run["log_path"]).parent
        cmd = eval_command(
            [
                "--model",
                run["settings"]["base_model"],
                "--model",
                run["output_dir"],
                "--output_dir",
                str(folder / EVAL_DIR),
                *self.eval_args,
            ]
        )
        with open(folder / EVAL_LOG, "ab") as log:
            log.write(
                f"{LAUNCH_MARK} #{run['id']}'s eval at {utcnow():%Y-%m-%d %H:%M:%S} UTC: {' '.join(cmd)}\n".encode()
            )
            log.flush()
            proc = subprocess.Popen(
                [*self._niced(), *cmd], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._evals[run["id"]] = proc
        # its process, for a manager that did not start it (a restarted server, a watcher): pid and start time
        started = psutil.Process(proc.pid).create_time()
        write_text_atomically(folder / EVAL_PID, json.dumps({"pid": proc.pid, "pid_started": started}))

    def eval_report(self, run: dict[str, Any]) -> dict[str, Any] | None:
        """Run ``run``'s eval report (chat-e eval's JSON), None while there is none."""
        path = Path(run["log_path"]).parent / EVAL_DIR / "eval.json"
        return json.loads(path.read_text()) if path.is_file() else None

    def eval_state(self, run: dict[str, Any]) -> str:
        """``none`` (not started), ``running``, ``done`` or ``failed`` (ended without a report: its log says why)."""
        folder = Path(run["log_path"]).parent
        if (folder / EVAL_DIR / "eval.json").is_file():
            return "done"
        if not (folder / EVAL_LOG).exists():
            return "none"
        proc = self._evals.get(run["id"])
        if proc is not None:
            return "running" if proc.poll() is None else "failed"
        pid_file = folder / EVAL_PID
        started_by_another = json.loads(pid_file.read_text()) if pid_file.is_file() else {}
        return "running" if started_by_another and self._alive(started_by_another) else "failed"

    def eval_markdown(self, run: dict[str, Any]) -> str:
        """What the Train page shows of run ``run``'s eval."""
        state = self.eval_state(run)
        folder = Path(run["log_path"]).parent
        if state == "running":
            return f"Evaluating run #{run['id']}'s model beside `{run['settings']['base_model']}` (chat-e eval)…"
        if state == "failed":
            tail = "\n".join(_tail(folder / EVAL_LOG, 3))
            return f"Run #{run['id']}'s eval ended without a report; its log ({folder / EVAL_LOG}) ends:\n```\n{tail}\n```"
        if state == "none":
            return ""
        report = self.eval_report(run)
        worse = report["worse"]
        verdict = (
            f"**Worse beyond the 95 % interval on: {', '.join(worse)}.**"
            if worse
            else "Worse beyond the 95 % interval on no score."
        )
        table = (folder / EVAL_DIR / "eval.md").read_text()
        return f"Run #{run['id']}'s model (2nd) beside `{run['settings']['base_model']}` (1st): {verdict}\n\n{table}"

    def promotion_doubt(self, run_id: int) -> str | None:
        """Why promoting run ``run_id``'s model needs a confirmation (None: it needs none): its eval is not there yet,
        or says it is worse than the model it was trained from beyond the 95 % interval on some score."""
        run = self._get(run_id)
        state = self.eval_state(run)
        if state != "done":
            return (
                f"Run #{run_id}'s eval is {'still running' if state == 'running' else 'missing'}, so nobody "
                f"knows whether its model is worse"
            )
        worse = self.eval_report(run)["worse"]
        if worse:
            return (
                f"Run #{run_id}'s model is worse than the model it was trained from beyond the 95 % interval on "
                + (", ".join(worse))
            )
        return None

    def _settle(self, run: dict[str, Any], code: int | None) -> None:
        """Record how ``run`` ended: ``code`` is its exit status, None when another process started it."""
        out, log = Path(run["output_dir"]), Path(run["log_path"])
        text = _log_text(log)
        text = text[text.rfind(LAUNCH_MARK) :] if LAUNCH_MARK in text else text  # this launch's lines only
        tail = "\n".join(_lines(text)[-LOG_TAIL_LINES:])
        report = out / PREFERENCE_REPORT
        # hf-ext's record once every rank saved the preemption checkpoint (the launcher's own exit status varies:
        # torchrun's agent, signalled too, exits 1)
        record = read_preemption_record(log.parent / PREEMPTION_RECORD)
        preempted = code == PREEMPTED_EXIT_CODE or record is not None
        fields: dict[str, Any] = {"ended_at": utcnow()}
        if code in (0, None) and report.is_file():
            metrics = json.loads(report.read_text())
            fields.update(status=DONE, metrics_before=metrics.get("before"), metrics_after=metrics.get("after"))
        elif preempted and list(out.glob("checkpoint-*")):
            how = f"exit status {code}" if code is not None else "its log says so"
            fields.update(status=STOPPED, detail=f"stopped with a checkpoint ({how})\n{tail}")
        elif run["status"] == CANCELLING and list(out.glob("checkpoint-*")):  # a resumed run, before a new step
            fields.update(status=STOPPED, detail=f"stopped before a new step: its last checkpoint is kept\n{tail}")
        elif run["status"] == CANCELLING:  # cancelled before a step ran (start-up, the evaluation before)
            fields.update(status=CANCELLED, detail=f"cancelled before its first step: nothing to resume\n{tail}")
        else:
            status = "its process is gone" if code is None else f"exit status {code}"
            reasons = [line.split(STOP_MARK, 1)[1] for line in _lines(text) if STOP_MARK in line]
            why = f"{reasons[-1]} ({status})" if reasons else status  # the training's own line, where it gave one
            fields.update(status=FAILED, detail=f"failed: {why}\n{tail}")
        self.store.update_run(run["id"], **fields)
        logger.info(
            "run #%d ended %s (%s)",
            run["id"],
            fields["status"],
            f"exit status {code}" if code is not None else "started by another process",
        )

    def progress(self, run_id: int) -> dict[str, Any]:
        """Run ``run_id``'s step, steps, ETA (seconds), logged series and last log lines."""
        run = self._get(run_id)
        records = read_progress(Path(run["log_path"]).parent / "progress.jsonl")
        logs = [r for r in records if r.get("event") == "log" and "loss" in r]
        steps = [r for r in records if r.get("event") in ("begin", "log")]
        step = steps[-1]["step"] if steps else 0
        total = steps[-1]["max_steps"] if steps else run["settings"]["form"]["max_steps"]
        begins = [i for i, r in enumerate(records) if r.get("event") == "begin"]
        recent = [r for r in records[begins[-1] if begins else 0 :] if r.get("event") == "log" and "loss" in r]
        eta = None  # from this process's steps only (a resumed run's earlier ones were before a pause)
        if len(recent) >= 2 and recent[-1]["step"] > recent[0]["step"]:
            per_step = (recent[-1]["time"] - recent[0]["time"]) / (recent[-1]["step"] - recent[0]["step"])
            eta = per_step * max(0, total - step)
        series = {
            key: [(r["step"], r[key]) for r in logs if key in r]
            for key in ("loss", "rewards/margins", "rewards/accuracies")
        }
        return {
            "run": run,
            "step": step,
            "max_steps": total,
            "eta_s": eta,
            "series": series,
            "log_tail": _tail(Path(run["log_path"]), LOG_TAIL_LINES),
            **current_phase(records),
        }


def current_phase(records: list[dict]) -> dict[str, Any]:
    """The part of its newest launch a run is in (:data:`chat_e.training.progress.PHASES`; None before the training
    wrote any), since when (a timestamp), the replies an evaluation has scored of how many (None until known), and
    the rows' split as the training kept them (``training_rows``, ``held_out_rows``; {} until known)."""
    starts = [i for i, r in enumerate(records) if r.get("event") == "phase" and r.get("phase") == PREPARING]
    launch = records[starts[-1] :] if starts else records
    split = next(
        (
            {k: r[k] for k in ("training_rows", "held_out_rows")}
            for r in reversed(launch)
            if r.get("event") == "phase" and "held_out_rows" in r
        ),
        {},
    )
    marks = [i for i, r in enumerate(launch) if r.get("event") in ("phase", "begin")]
    if not marks:
        return {"phase": None, "phase_since": None, "split": split, "rows": None}
    last = launch[marks[-1]]
    name = TRAINING if last["event"] == "begin" else last["phase"]
    rows = next(
        (
            (r["done"], r["total"])
            for r in reversed(launch[marks[-1] :])
            if r.get("event") == "rows" and r["phase"] == name
        ),
        None,
    )
    return {"phase": name, "phase_since": last["time"], "split": split, "rows": rows}


def run_processes(pid: int) -> list[psutil.Process]:
    """A run's processes: its launcher ``pid`` and everything below it (torchrun starts its ranks in sessions of
    their own, so its process group alone does not hold them)."""
    try:
        launcher = psutil.Process(pid)
        return [launcher, *launcher.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def signal_ranks(pid: int, sig: signal.Signals) -> None:
    """``sig`` to the ranks of the run whose launcher is ``pid`` (the processes with ``LOCAL_RANK`` in their
    environment; the launcher itself when it is the one rank). Not to the launcher: torchrun and DeepSpeed's launcher
    pass a signal on and kill the ranks 30 s later, which a step and a checkpoint of a larger model can outlast. The
    ranks save, exit with status 75, and the launcher ends with them."""
    processes = run_processes(pid)
    ranks = []
    for process in processes[1:]:
        try:
            if "LOCAL_RANK" in process.environ():
                ranks.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    for process in ranks or processes[:1]:
        try:
            process.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def _log_text(path: Path, size: int = 256 * 1024) -> str:
    """The last ``size`` bytes of a log, as text (empty when there is none)."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - size))
            return f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return ""


def _lines(text: str) -> list[str]:
    """Non-empty lines; a progress bar's carriage returns end lines too."""
    return [line for line in text.replace("\r", "\n").splitlines() if line.strip()]


def _tail(path: Path, lines: int) -> list[str]:
    return _lines(_log_text(path, 64 * 1024))[-lines:]
