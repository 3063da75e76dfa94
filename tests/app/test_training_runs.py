"""Training runs started from the app's feedback (chat_e.studio.runs): a real DPO run of the tiny chat model on rows
exported from a real database, cancelled with a checkpoint, resumed by an app restarted mid-run, finished with its
held-out metrics before and after; a run whose process died is shown failed with its last log lines; one run at a
time; bad form values refused in one line before anything starts."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest

from chat_e.feedback.store import RUNNING, FeedbackStore
from chat_e.studio.runs import RunForm, RunManager, run_processes, signal_run

from ..conftest import ROOT
from .support import UI_SETTINGS, ChatEServer, gradio_client, serving

pytestmark = pytest.mark.slow

PREFERENCE_TINY = ROOT / "recipes" / "configs" / "preference_tiny.yaml"
TRAIN_ARGS = ["--config", str(PREFERENCE_TINY), "--n_eval", "4", "--per_device_train_batch_size", "4"]


def choice(i: int) -> dict:
    """A stored choice of a reply over its regeneration (distinct texts, so that every one is a DPO pair)."""
    return dict(kind="choice", reply_id=f"r{i}", model="tiny", reply=f"I like apples number {i}.",
                other_reply_id=f"o{i}", other_reply=f"no {i}", session_id=f"s{i}", mode="none", context="",
                history=["hello", "hi there"], message=f"What do you like, {i}?", settings={})  # fmt: skip


@pytest.fixture
def store(tmp_path):
    store = FeedbackStore(f"sqlite:///{tmp_path}/feedback.db")
    yield store
    store.close()


@pytest.mark.parametrize("form, says", [
    (RunForm(method="sft"), "method='sft': choose dpo or kto"),
    (RunForm(max_steps=0), "steps=0: choose a whole number from 1 to 100,000"),
    (RunForm(lora_rank=-1), "LoRA rank=-1"),
    (RunForm(learning_rate=0), "learning rate=0"),
    (RunForm(nproc=1000, launcher="torchrun"), "ranks=1000: choose 1 to"),
    (RunForm(nproc=2), "The python launcher starts one rank"),
    (RunForm(preset="zero2"), "needs a distributed launcher"),
])  # fmt: skip
def test_bad_form_values_are_refused_in_one_line_before_anything_starts(form, says, store, tmp_path):
    store.add_feedback(**choice(0))
    with pytest.raises(ValueError, match=says.replace("(", r"\(")) as refused:
        RunManager(store, "unused", tmp_path / "runs").start(form)
    assert "\n" not in str(refused.value)
    assert store.runs() == [] and not (tmp_path / "runs").exists()


def test_no_rows_of_the_format_is_refused_with_the_reasons(store, tmp_path):
    store.add_feedback(**{**choice(0), "kind": "rating", "rating": 1})
    with pytest.raises(ValueError, match=r"no DPO rows yet \(1 rating \(KTO and SFT only\)\)"):
        RunManager(store, "unused", tmp_path / "runs").start(RunForm())
    assert store.runs() == []


def wait_for(what, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while not (value := what()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)
    return value


ADMIN = ("op", "s3cret")
STEPS = 30
FORM = {"method": "dpo", "max_steps": STEPS, "lora_rank": 0, "learning_rate": 1e-3, "launcher": "torchrun", "nproc": 2,
        "preset": "none"}  # fmt: skip


def train_page(server: ChatEServer):
    return gradio_client(f"{server.url}admin/", auth=ADMIN)


def newest(client) -> dict:
    """The Train page's newest run, as its ``/status`` endpoint shows it (the status line and the runs table)."""
    line, bar, plot, log, table, summary = client.predict(api_name="/status")
    rows = table["data"] if isinstance(table, dict) else table
    return {"line": line, "bar": bar, "plot": plot, "log": log, "row": rows[0] if rows else None, "summary": summary}


def step_of(shown: dict) -> int:
    found = re.search(rf"step (\d+) of {STEPS}", shown["line"])
    return int(found.group(1)) if found else -1


def served_id(server: ChatEServer) -> tuple[str, str]:
    """The model id ``/v1/models`` gives, and the one an answer names."""
    listed = httpx.get(f"{server.url}v1/models", timeout=30).raise_for_status().json()["data"][0]["id"]
    body = {"model": listed, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
    answer = httpx.post(f"{server.url}v1/chat/completions", json=body, timeout=60).raise_for_status().json()
    return listed, answer["model"]


def from_run_to_served_model(server: ChatEServer, page, run: dict, store: FeedbackStore, base: Path) -> None:
    """The Train page's "Served model" section on the finished run: the app's blind arena between the served model
    and the run's (closed until opened, votes in the database, the two-model leaderboard), side by side, Promote
    (the API and new feedback rows name the run's model, no restart) and Roll back."""
    trained, base = str(Path(run["output_dir"]).resolve()), str(base.resolve())
    assert served_id(server) == (base, base)
    arena = gradio_client(f"{server.url}arena/")
    with pytest.raises(Exception, match="No arena is open now"):
        arena.predict("hello", "free", "", api_name="/battle")
    with pytest.raises(Exception, match=r"Run #999 has no model to serve: choose a run that is done"):
        page.predict(999, api_name="/open_arena")
    assert "**Arena open**" in page.predict(run["id"], api_name="/open_arena")
    winners = ["model_a", "model_b", "tie", "model_a", "bothbad"]
    for i, winner in enumerate(winners):
        arena.predict(api_name="/new_battle")
        arena.predict(f"What do you like, {i}?", "free", "", api_name="/battle")
        assert "Model A** was" in arena.predict(winner, api_name="/vote")
    votes = store.votes()
    assert len(votes) == 5 and {v["model_a"] for v in votes} | {v["model_b"] for v in votes} == {base, trained}
    table, text, _ = arena.predict(api_name="/leaderboard")
    rows = table["data"] if isinstance(table, dict) else table
    assert {row[0] for row in rows} == {base, trained} and "95% CI" in text, text
    sides = page.predict(run["id"], "What do you like?", api_name="/side_by_side")
    assert f"**served** `{base}`" in sides and f"`{trained}`" in sides

    promoted = page.predict(run["id"], api_name="/promote")
    assert f"promoted from run #{run['id']}" in promoted and f"Roll back returns to `{base}`" in promoted
    assert served_id(server) == (trained, trained)  # no restart
    with pytest.raises(Exception, match="No arena is open now"):  # its pairing named the model served before
        arena.predict(api_name="/new_battle")
    chat = gradio_client(server.url)
    _, window, *_ = chat.predict("hello, who are you?", [], api_name="/add_message")
    window = chat.predict(window, "free", "", *UI_SETTINGS, api_name="/respond")
    chat.predict(len(window) - 1, "like", api_name="/rate")
    assert store.feedback()[-1]["model"] == trained
    assert "rolled back" in page.predict(api_name="/rollback")
    assert served_id(server) == (base, base)
    with pytest.raises(Exception, match="Nothing to roll back to"):
        page.predict(api_name="/rollback")
    arena.close()
    chat.close()


def test_the_train_page_runs_cancels_reattaches_and_resumes_a_dpo_run(tiny_chat_model_dir, tmp_path):
    """The operator's page on a real server: Start, the progress and plot, Cancel (a checkpoint), the server
    restarted mid-run (the training goes on in its own process group; the new server reattaches), Resume to the end
    with before/after metrics, and a run whose process dies shown failed with its exit status."""
    url = f"sqlite:///{tmp_path}/feedback.db"
    store = FeedbackStore(url)
    for i in range(24):
        store.add_feedback(**choice(i))
    args = ("--admin", ":".join(ADMIN), "--train_args", " ".join(TRAIN_ARGS), "--train_dir", str(tmp_path / "train"))
    first = ChatEServer(tiny_chat_model_dir, tmp_path / "first.log", *args, feedback_db=url)
    with serving(first):
        client = train_page(first)
        assert "| DPO | 24 |" in newest(client)["summary"]
        for bad, says in (({"max_steps": 0}, "steps=0"), ({"learning_rate": 0}, "learning rate=0")):
            with pytest.raises(Exception, match=says):
                client.predict(*{**FORM, **bad}.values(), api_name="/start")
        client.predict(*FORM.values(), api_name="/start")
        run = store.runs()[0]
        # the training runs in its own process group, niced: the launcher and, once started, its 2 ranks
        assert os.getpgid(run["pid"]) == run["pid"]
        wait_for(lambda: len(run_processes(run["pid"])) >= 3)
        assert all(os.getpriority(os.PRIO_PROCESS, p.pid) >= 10 for p in run_processes(run["pid"]))
        with pytest.raises(Exception, match=f"Run #{run['id']} is running: cancel it or wait"):
            client.predict(*FORM.values(), api_name="/start")
        shown = wait_for(lambda: step_of(s := newest(client)) >= 2 and s)
        assert "<progress" in shown["bar"] and f'max="{STEPS}"' in shown["bar"] and shown["plot"]
        # the training is paused (SIGSTOP, a real signal) while the server restarts, so that it is still mid-run
        # when the next server comes up, however fast the steps and however slow the restart
        signal_run(run["pid"], signal.SIGSTOP)
        client.close()
    # the server went away mid-run; the training did not
    assert store.run(run["id"])["status"] == RUNNING and psutil.pid_exists(run["pid"])
    second = ChatEServer(tiny_chat_model_dir, tmp_path / "second.log", *args, feedback_db=url)
    with serving(second):
        client = train_page(second)
        assert "**running**" in newest(client)["line"]  # reattached
        signal_run(run["pid"], signal.SIGCONT)
        client.predict(api_name="/cancel")
        stopped = wait_for(lambda: "**stopped**" in (s := newest(client))["line"] and s)
        assert "stopped with a checkpoint (its log says so)" in store.run(run["id"])["detail"]
        assert re.search(r"Preempted \(SIGTERM\): checkpoint-\d+ is saved", Path(run["log_path"]).read_text())
        assert stopped["log"]  # the page shows the log's last lines (here torchrun's own report of the signal)
        assert len(list(Path(store.run(run["id"])["output_dir"]).glob("checkpoint-*"))) == 1
        client.predict(api_name="/resume")
        done = wait_for(lambda: "**done**" in (s := newest(client))["line"] and s)
        assert re.search(r"Held-out: reward accuracy [\d.]+ → [\d.]+; reward margin", done["line"]), done["line"]
        record = store.run(run["id"])
        assert {"eval_rewards/accuracies", "eval_rewards/margins"} <= set(record["metrics_before"]) & set(
            record["metrics_after"]
        )
        assert (Path(record["output_dir"]) / "model.safetensors").is_file()
        assert step_of(done) == STEPS and done["plot"]
        from_run_to_served_model(second, client, record, store, tiny_chat_model_dir)

        # a run whose process dies (SIGKILL, as the OOM killer would) is shown failed with its exit status
        client.predict(*{**FORM, "method": "kto", "launcher": "python", "nproc": 1}.values(), api_name="/start")
        os.killpg(store.runs()[0]["pid"], signal.SIGKILL)
        failed = wait_for(lambda: "**failed**" in (s := newest(client))["line"] and s)
        assert f"failed: exit status -{signal.SIGKILL.value}" in failed["line"]
        client.close()
    store.close()
