"""Training runs started from the app's feedback (chat_e.studio.runs): a real DPO run of the tiny chat model on rows
exported from a real database, cancelled with a checkpoint, resumed by an app restarted mid-run, finished with its
held-out metrics before and after; a run whose process died is shown failed with its last log lines; one run at a
time; bad form values refused in one line before anything starts."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import psutil
import pytest

from chat_e.feedback.store import DONE, RUNNING, FeedbackStore
from chat_e.studio.runs import RunForm, RunManager, current_phase, run_processes
from chat_e.training.progress import AUTOGROUP, EVAL_AFTER, EVAL_BEFORE, PREPARING, SAVING, TRAINING, read_progress

from ..conftest import ROOT
from .browser import BOT, keep_screenshot, needs_chromium, wait_for_reply
from .support import ChatEServer, gradio_client, make_sensitive_model, serving

pytestmark = pytest.mark.slow

PREFERENCE_TINY = ROOT / "recipes" / "configs" / "preference_tiny.yaml"
TRAIN_ARGS = ["--config", str(PREFERENCE_TINY)]
#: a done run's eval beside the served model, kept short (its report is tested in tests/integration/test_chat_eval.py)
EVAL_ARGS = ["--n_nll", "8", "--max_new_tokens", "8"]


def signal_run(pid: int, sig: signal.Signals) -> None:
    """``sig`` to every process of the run whose launcher is ``pid`` (as a scheduler or an operator would)."""
    for process in run_processes(pid):
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(sig)


def choice(i: int) -> dict:
    """A stored choice of a reply over its regeneration (distinct texts, so that every one is a DPO pair)."""
    return dict(kind="choice", reply_id=f"r{i}", model="tiny", reply=f"I like apples number {i}.",
                other_reply_id=f"o{i}", other_reply=f"no {i}", session_id=f"s{i}", mode="none", context="",
                history=["hello", "hi there"], message=f"What do you like, {i}?", settings={})  # fmt: skip


def test_promote_asks_for_confirmation_while_the_eval_is_missing_or_says_worse(store, tmp_path):
    folder = tmp_path / "run-1"
    (folder / "eval").mkdir(parents=True)
    settings = {"form": {}, "command": [], "base_model": "served"}
    run_id = store.add_run(method="dpo", settings=settings, rows=1, rows_sha256="", status=DONE,
                           output_dir=str(folder / "out"), log_path=str(folder / "train.log"))  # fmt: skip
    manager = RunManager(store, "served", tmp_path)
    assert manager.promotion_doubt(run_id).startswith(f"Run #{run_id}'s eval is missing")
    report = folder / "eval" / "eval.json"
    report.write_text(json.dumps({"worse": ["instructions (strict)", "human-reply NLL/token"]}))
    assert manager.promotion_doubt(run_id) == (
        f"Run #{run_id}'s model is worse than the model it was trained from beyond the 95 % interval on "
        "instructions (strict), human-reply NLL/token"
    )
    report.write_text(json.dumps({"worse": []}))
    assert manager.promotion_doubt(run_id) is None


@pytest.fixture
def store(tmp_path):
    store = FeedbackStore(f"sqlite:///{tmp_path}/feedback.db")
    yield store
    store.close()


@pytest.mark.parametrize("form, says", [
    (RunForm(method="orpo"), "method='orpo': choose one of dpo, kto, sft, kto+sft"),
    (RunForm(max_steps=0), "steps=0: choose a whole number from 1 to 100,000"),
    (RunForm(lora_rank=-1), "LoRA rank=-1"),
    (RunForm(learning_rate=0), "learning rate=0"),
    (RunForm(method="kto+sft", sft_weight=0), "SFT weight=0: choose a number above 0 and at most 100"),
    (RunForm(nproc=1000, launcher="torchrun"), "ranks=1000: choose 1 to"),
    (RunForm(nproc=2), "The python launcher starts one rank"),
    (RunForm(preset="zero2"), "needs a distributed launcher"),
    (RunForm(held_out=0), "held-out rows=0: choose a whole number from 1 to 1024"),
    (RunForm(max_length=8), "max length=8: choose a whole number from 32 to 8192"),
    (RunForm(method="dpo", replay=8), "replay=8 with DPO's loss sigmoid: a replayed row has no worse reply"),
])  # fmt: skip
def test_bad_form_values_are_refused_in_one_line_before_anything_starts(form, says, store, tmp_path):
    store.add_feedback(**choice(0))
    with pytest.raises(ValueError, match=re.escape(says)) as refused:
        RunManager(store, "unused", tmp_path / "runs").start(form)
    assert "\n" not in str(refused.value)
    assert store.runs() == [] and not (tmp_path / "runs").exists()


def test_no_rows_of_the_format_is_refused_with_the_reasons(store, tmp_path):
    store.add_feedback(**{**choice(0), "kind": "rating", "rating": 1})
    with pytest.raises(ValueError, match=r"no DPO rows yet \(1 rating \(no pair\)\)"):
        RunManager(store, "unused", tmp_path / "runs").start(RunForm())
    assert store.runs() == []


def test_corrections_train_sft_with_a_held_out_before_after(tiny_chat_model_dir, store, tmp_path):
    """SFT from the page's form on 16 corrections of 8 sessions: the run trains the corrected replies (TRL's DPO
    trainer with its sft loss, the rows exported as DPO pairs) and reports the same held-out before/after as DPO: on
    the corrections of sessions it never trained on, their NLL falls (the corrections share their wording, which
    the original replies do not) and the model prefers them over the replies they corrected."""
    for i in range(16):
        store.add_feedback(**{**choice(i), "kind": "edit", "session_id": f"s{i // 2}", "reply": f"no {i}, maybe.",
                              "edited": f"I like apples, number {i}. And you?"})  # fmt: skip
    manager = RunManager(store, str(tiny_chat_model_dir), tmp_path / "runs", TRAIN_ARGS, EVAL_ARGS)
    manager.niceness = 0
    run_id = manager.start(
        RunForm(method="sft", max_steps=10, lora_rank=0, learning_rate=1e-2, launcher="python", held_out=4, replay=6)
    )
    run = wait_for(lambda: manager.refresh() and (r := store.run(run_id))["status"] != RUNNING and r, timeout=300)
    assert run["status"] == DONE, run["detail"]
    assert run["settings"]["command"][-6:] == ["--replay", "6", "--loss_type", "sft", "--loss", "dpo"]
    folder = Path(run["log_path"]).parent
    assert sorted(p.name for p in folder.glob("*.jsonl")) == ["dpo.jsonl", "progress.jsonl"]
    report = json.loads((Path(run["output_dir"]) / "preference_metrics.json").read_text())
    assert report["loss_type"] == ["sft"] and report["eval_rows"] == run["metrics_after"]["rows"] >= 4
    before, after = run["metrics_before"], run["metrics_after"]
    assert after["reply_nll"] < before["reply_nll"] - 1.0
    assert after["preferred_sum"]["k"] == after["preferred_sum"]["n"] > before["preferred_sum"]["k"]
    # every part of the run outside the training loop, in order, the split with the evaluation before
    records = read_progress(folder / "progress.jsonl")
    parts = [r["phase"] if r["event"] == "phase" else r["event"] for r in records if r["event"] not in ("log", "rows")]
    assert parts == [PREPARING, EVAL_BEFORE, "begin", "end", EVAL_AFTER, SAVING]
    # 12 corrections and 6 replayed rows of make demo's corpus trained on; only corrections held out
    assert records[1]["training_rows"] == report["train_rows"] == 12 + 6 and records[1]["held_out_rows"] == 4
    # each evaluation says how far it has come: 4 held-out pairs, 8 replies scored in one pass of the eval batch (8)
    rows = [(r["phase"], r["done"], r["total"]) for r in records if r["event"] == "rows"]
    assert rows == [(EVAL_BEFORE, 8, 8), (EVAL_AFTER, 8, 8)]
    assert current_phase(records[:3]) == {"phase": EVAL_BEFORE, "phase_since": records[1]["time"], "rows": (8, 8),
                                          "split": {"training_rows": 18, "held_out_rows": 4}}  # fmt: skip
    assert current_phase(records)["phase"] == SAVING and current_phase(records)["rows"] is None
    begin = next(i for i, r in enumerate(records) if r["event"] == "begin")
    assert current_phase(records[: begin + 1])["phase"] == TRAINING
    for proc in manager._evals.values():  # the done run's eval (tested with the browser's run) is not waited for
        proc.kill()
        proc.wait()


def test_cancel_before_the_first_step_ends_cancelled_and_a_second_cancel_sends_nothing(tiny_chat_model_dir, store,
                                                                                      tmp_path):  # fmt: skip
    """Cancel while the run is starting (no step, no checkpoint): ``cancelling`` at once, a second Cancel refused
    without a signal, then ``cancelled`` with the reason (not ``failed``), and nothing to resume."""
    store.add_feedback(**choice(0))
    store.add_feedback(**choice(1))
    manager = RunManager(store, str(tiny_chat_model_dir), tmp_path / "runs", TRAIN_ARGS)
    manager.niceness = 0
    run_id = manager.start(RunForm(max_steps=5, lora_rank=0, launcher="python"))
    manager.cancel(run_id)
    assert store.run(run_id)["status"] == "cancelling"
    with pytest.raises(ValueError, match=f"Run #{run_id} is cancelling already: it saves a checkpoint and stops"):
        manager.cancel(run_id)
    run = wait_for(lambda: manager.refresh() and (r := store.run(run_id))["status"] != "cancelling" and r)
    assert run["status"] == "cancelled"
    assert run["detail"].startswith("cancelled before its first step: nothing to resume")
    with pytest.raises(ValueError, match=f"Run #{run_id} is cancelled: only a stopped run resumes"):
        manager.resume(run_id)
    assert manager._procs == {} and manager.start(RunForm(max_steps=5, lora_rank=0, launcher="python")) > run_id
    manager.cancel(store.runs()[0]["id"])
    wait_for(lambda: manager.refresh() and store.runs()[0]["status"] == "cancelled")


def wait_for(what, timeout: float = 180):
    deadline = time.monotonic() + timeout
    while not (value := what()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.3)
    return value


ADMIN = ("op", "s3cret")
STEPS = 30
FORM = {"method": "dpo", "max_steps": STEPS, "lora_rank": 0, "learning_rate": 5e-4, "launcher": "torchrun", "nproc": 2,
        "preset": "none", "held_out": 4, "batch": 4, "max_length": 128, "replay": 0, "sft_weight": 1}  # fmt: skip


def train_page(server: ChatEServer):
    return gradio_client(f"{server.url}admin/", auth=ADMIN)


def newest(client) -> dict:
    """The Train page's newest run, as its ``/status`` endpoint shows it (the status line and the runs table)."""
    line, bar, plot, log, table, summary, evaluation = client.predict(api_name="/status")
    rows = table["data"] if isinstance(table, dict) else table
    return {"line": line, "bar": bar, "plot": plot, "log": log, "row": rows[0] if rows else None, "summary": summary,
            "eval": evaluation}  # fmt: skip


def served_id(server: ChatEServer) -> tuple[str, str]:
    """The model id ``/v1/models`` gives, and the one an answer names."""
    listed = httpx.get(f"{server.url}v1/models", timeout=30).raise_for_status().json()["data"][0]["id"]
    body = {"model": listed, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}
    answer = httpx.post(f"{server.url}v1/chat/completions", json=body, timeout=60).raise_for_status().json()
    return listed, answer["model"]


def log_in(page, url: str) -> None:
    """The Train page at ``url``, through Gradio's login form as the operator (once per server: its cookie stays)."""
    page.goto(url)
    page.wait_for_selector("#train-status, input[type=password]", timeout=60_000)
    if page.locator("input[type=password]").count():
        page.get_by_label("username").fill(ADMIN[0])
        page.get_by_label("password").fill(ADMIN[1])
        page.get_by_role("button", name="Login").click()
    page.wait_for_selector("#train-status", timeout=60_000)


def shown(page, selector: str) -> str:
    return " ".join(page.locator(selector).inner_text().split())


#: how long the page may take to show a run's next state (ms); a real model (CHAT_E_TEST_MODEL) trains for minutes
WAIT_MS = 1_800_000 if os.environ.get("CHAT_E_TEST_MODEL") else 180_000


def wait_shown(page, selector: str, text: str, timeout: float = WAIT_MS) -> str:
    """Until the element shows ``text`` (the page refreshes itself: a gr.Timer); what it shows then."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    try:
        page.wait_for_function(
            "([sel, want]) => document.querySelector(sel)?.innerText.includes(want)",
            arg=[selector, text],
            timeout=timeout,
        )
    except PlaywrightTimeout:
        toasts = page.locator(".toast-body").all_inner_texts()
        raise AssertionError(
            f"{selector} never showed {text!r}: it shows {shown(page, selector)!r}; toasts {toasts}"
        ) from None
    return shown(page, selector)


def progress_value(page) -> int:
    bar = page.locator("#train-progress progress")
    return int(float(bar.get_attribute("value"))) if bar.count() else -1


def screenshot(page, tmp_path: Path, name: str) -> None:
    shot = tmp_path / name
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    keep_screenshot(shot, name)


@pytest.fixture
def reaped_store(tmp_path):
    """The test's feedback database (URL, store). A run outlives the server that started it, so at the end every run
    it recorded that is still running is killed (SIGKILL), whether the test passed or not."""
    url = f"sqlite:///{tmp_path}/feedback.db"
    store = FeedbackStore(url)
    yield url, store
    for run in store.runs():
        if RunManager._alive(run):
            signal_run(run["pid"], signal.SIGKILL)
    store.close()


@needs_chromium
def test_the_operator_turns_feedback_into_a_served_model_in_the_browser(tiny_chat_model_dir, tmp_path, page,
                                                                         reaped_store):  # fmt: skip
    """The loop, as the operator clicks it in headless Chromium on a real server: rate and correct 10 replies;
    log in to the Train page and see the 10 DPO rows; start a DPO run (2 ranks under torchrun), watch its progress
    and plot; the server restarted mid-run and the page reattached; Cancel ("cancelling" shown, then a checkpoint),
    Resume to the end with the held-out metrics before and after; open the app's blind arena between the served model and the run's and vote 5
    battles; Promote and chat with the new model; Roll back; Cancel during a run's evaluation before training
    ("cancelled", nothing to resume) and a run whose prompts the max length cuts away ("failed" with the reason).
    The database, the API and the run's files are the oracle; gradio_client checks the refusals (bad values, a
    second Start, unknown runs) and a run whose process dies shown failed with its exit status."""
    url, store = reaped_store
    # the tiny chat model with weights that give replies that are not empty; CHAT_E_TEST_MODEL=runs/demo
    # CHAT_E_SCREENSHOTS=docs: the demo model, and the screenshots of docs/feedback.md
    chosen = os.environ.get("CHAT_E_TEST_MODEL")
    model = (
        Path(chosen).resolve() if chosen else make_sensitive_model(tiny_chat_model_dir, tmp_path / "model", std=0.5)
    )
    base = str(Path(model).resolve())
    args = ("--admin", ":".join(ADMIN), "--train_args", " ".join(TRAIN_ARGS), "--train_dir", str(tmp_path / "train"),
            "--eval_args", " ".join(EVAL_ARGS))  # fmt: skip
    first = ChatEServer(model, tmp_path / "first.log", *args, feedback_db=url)
    with serving(first):
        # a chat user's feedback: 10 replies, each liked and corrected
        page.goto(first.url)
        page.wait_for_selector("#chatbot")
        for i in range(10):
            if i and i % 2 == 0:  # five users' chats of two messages each: the run holds out whole sessions
                page.reload()
                page.wait_for_selector("#chatbot")
            page.locator("#message textarea").fill(f"What do you like, number {i}?")
            page.locator("#send").click()
            wait_for_reply(page, i % 2 + 1)
            page.locator(BOT).last.hover()
            page.locator("#chatbot").get_by_label("Like", exact=True).last.click()
            wait_for(lambda n=2 * i + 1: len(store.feedback()) == n)
            page.locator("#correction textarea").fill(f"I like apples, number {i}.")
            page.locator("#save-correction").click()
            wait_for(lambda n=2 * i + 2: len(store.feedback()) == n)
        kinds = [row["kind"] for row in store.feedback()]
        assert kinds.count("rating") == 10 and kinds.count("edit") == 10
        assert len({row["session_id"] for row in store.feedback()}) == 5
        screenshot(page, tmp_path, "chat-e-feedback-10.png")

        # the Train page: the rows, a refused value, Start
        log_in(page, f"{first.url}admin/")
        wait_for(lambda: re.search(r"DPO rows\s+10\s", page.locator("#train-data").inner_text()))
        client = train_page(first)
        for bad, says in (
            ({"max_steps": 0}, "steps=0"),
            ({"learning_rate": 0}, "learning rate=0"),
            ({"learning_rate": None}, "learning rate is empty: give a number"),
        ):
            with pytest.raises(Exception, match=says):
                client.predict(*{**FORM, **bad}.values(), api_name="/start")
        # a value the browser cannot take as a number: the page refuses it in a notice that stays until closed,
        # never starting with the value the field held before
        page.locator("#train-steps input").press_sequentially("e")
        page.locator("#train-steps input").press("Tab")
        page.locator("#train-start").click()
        notice = page.locator(".toast-body", has_text="steps")
        notice.wait_for(timeout=30_000)
        assert "give a whole number" in notice.inner_text() and store.runs() == []
        notice.locator(".toast-close").click()
        lora = 16 if chosen else 0  # a real model trains its LoRA adapter, in minutes
        fill_form(page, "torchrun", steps=STEPS, lora=lora, ranks=2, held_out=4, max_length=128)
        page.locator("#train-start").click()
        # the run starts, or the page says why not (a toast, which fades: read at once)
        page.wait_for_function(
            "() => document.querySelector('#train-status')?.innerText.includes('running')"
            " || document.querySelector('.toast-body')",
            timeout=WAIT_MS,
        )
        assert not page.locator(".toast-body").count(), page.locator(".toast-body").all_inner_texts()
        run = store.runs()[0]
        assert run["settings"]["form"] == {**FORM, "lora_rank": lora}  # the form as filled in the browser
        # the training runs in its own process group, niced: the launcher and, once started, its 2 ranks
        assert os.getpgid(run["pid"]) == run["pid"]
        wait_for(lambda: len(run_processes(run["pid"])) >= 3)
        assert all(os.getpriority(os.PRIO_PROCESS, p.pid) >= 10 for p in run_processes(run["pid"]))
        ranks = [p for p in run_processes(run["pid"])[1:] if "chat_e.training" in " ".join(p.cmdline())]
        assert len(ranks) == 2
        if AUTOGROUP.exists():  # the kernel shares the CPU between sessions first: each rank's session is niced too
            wait_for(lambda: all(Path(f"/proc/{p.pid}/autogroup").read_text().split()[-1] == "10" for p in ranks))
        with pytest.raises(Exception, match=f"Run #{run['id']} is running: cancel it or wait"):
            client.predict(*FORM.values(), api_name="/start")
        page.wait_for_function("() => Number(document.querySelector('#train-progress progress')?.value) >= 2",
                               timeout=180_000)  # fmt: skip
        assert page.locator("#train-progress progress").get_attribute("max") == str(STEPS)
        page.wait_for_selector("#train-plot canvas, #train-plot svg", timeout=60_000)
        screenshot(page, tmp_path, "chat-e-train-running.png")
        # the page refuses a second Start in a notice that stays until it is closed (no timer fades it)
        page.locator("#train-start").click()
        notice = page.locator(".toast-body", has_text=f"Run #{run['id']} is running: cancel it or wait")
        notice.wait_for(timeout=30_000)
        assert notice.locator(".timer").count() == 0 and store.runs()[0]["id"] == run["id"]
        # the training is paused (SIGSTOP, a real signal) while the server restarts, so that it is still mid-run
        # when the next server comes up, however fast the steps and however slow the restart
        signal_run(run["pid"], signal.SIGSTOP)
        client.close()
    # the server went away mid-run; the training did not
    assert store.run(run["id"])["status"] == RUNNING and psutil.pid_exists(run["pid"])
    hold = tmp_path / "hold-in-evaluation"  # while it exists, the next run stops in its evaluation before training
    second = ChatEServer(model, tmp_path / "second.log", *args, feedback_db=url,
                         env={"CHAT_E_TEST_STOP_AT_PHASE": f"{EVAL_BEFORE}:{hold}"})  # fmt: skip
    with serving(second):
        log_in(page, f"{second.url}admin/")
        wait_shown(page, "#train-status", "running")  # reattached
        # Cancel while the training is still paused: its ranks' SIGTERM waits for SIGCONT, and the page says
        # "cancelling" from the click to the end
        page.locator("#train-cancel").click()
        wait_shown(page, "#train-status", "cancelling")
        assert store.run(run["id"])["status"] == "cancelling"
        signal_run(run["pid"], signal.SIGCONT)
        wait_shown(page, "#train-status", "stopped")
        assert "stopped with a checkpoint (its log says so)" in store.run(run["id"])["detail"]
        assert re.search(r"Preempted \(SIGTERM\): checkpoint-\d+ is saved", Path(run["log_path"]).read_text())
        assert page.locator("#train-log textarea").input_value()  # the log's last lines (torchrun's report)
        assert len(list(Path(store.run(run["id"])["output_dir"]).glob("checkpoint-*"))) == 1
        page.locator("#train-resume").click()
        done = wait_shown(page, "#train-status", "done")
        share = r"[\d.]+% \[[\d.]+%, [\d.]+%\] \(\d+/\d+\)"
        assert re.search(rf"Held-out \(\d+ rows; chosen against rejected\): prefers chosen {share} → {share}; per "
                         rf"token {share} → {share}; preferred reply NLL/token [\d.]+ → [\d.]+", done), done  # fmt: skip
        record = store.run(run["id"])
        for metrics in (record["metrics_before"], record["metrics_after"]):
            assert metrics["preferred_sum"]["n"] == metrics["rows"] > 0
        assert {"config.json", "adapter_config.json"} & {p.name for p in Path(record["output_dir"]).iterdir()}
        assert f"step {STEPS} of {STEPS}" in done
        screenshot(page, tmp_path, "chat-e-train-done.png")
        trained = str(Path(record["output_dir"]).resolve())
        trained_id = f"run-{run['id']}-dpo"  # its name outside the server: the folder stays on the server

        # the app's blind arena between the served model and the run's
        client = train_page(second)
        with pytest.raises(Exception, match=r"There is no run #999: choose a done run's number"):
            client.predict(999, api_name="/open_arena")
        page.locator("#served-run input").fill(str(run["id"]))
        arena = gradio_client(f"{second.url}arena/")
        with pytest.raises(Exception, match="No arena is open now"):  # until the operator opens one
            arena.predict(api_name="/new_battle")
        page.locator("#open-arena").click()
        wait_shown(page, "#serving", "Arena open")
        sides = client.predict(run["id"], "What do you like?", api_name="/side_by_side")
        assert f"**served** `{base}`" in sides and f"`{trained_id}`" in sides
        page.goto(f"{second.url}arena/")
        page.wait_for_selector("#arena-message")
        # a refused message: a toast; the panels are not marked "Error", the message stays to be shortened and sent
        page.locator("#arena-message textarea").fill("x" * 5000)
        page.locator("#arena-send").click()
        page.wait_for_selector(".toast-body:has-text('Shorten it and send again')", timeout=30_000)
        # a chat user's note fades (its timer runs), unlike the Train page's refusals above
        assert page.locator(".toast-body:has-text('Shorten it and send again') .timer").count() == 1
        page.wait_for_function("() => !document.querySelector('#arena-send').disabled")
        assert page.get_by_text("Error", exact=True).count() == 0
        assert page.locator("#arena-message textarea").input_value() == "x" * 5000
        for i, winner in enumerate(["model_a", "model_b", "tie", "model_a", "bothbad"]):
            assert page.locator("#vote-model_a").is_disabled()  # nothing to vote on yet
            page.locator("#arena-message textarea").fill(f"What do you like, {i}?")
            page.locator("#arena-send").click()
            page.wait_for_function("() => !document.querySelector('#vote-model_a').disabled", timeout=120_000)
            assert page.locator("#reveal").inner_text().strip() == ""  # the names stay hidden until the vote
            page.locator(f"#vote-{winner}").click()
            page.wait_for_function("() => document.querySelector('#reveal').innerText.includes('Model A')")
            vote, revealed = store.votes()[-1], page.locator("#reveal").inner_text()
            assert len(store.votes()) == i + 1 and vote["winner"] == winner and vote["turn"] == 1
            assert revealed.index(vote["model_a"]) < revealed.index(vote["model_b"])  # A is named first
            # one vote per battle: the buttons go dead
            page.wait_for_function("() => document.querySelector('#vote-model_b').disabled", timeout=60_000)
            if i == 0:
                screenshot(page, tmp_path, "chat-e-arena.png")
            page.locator("#new-battle").click()
            page.wait_for_function("() => document.querySelector('#reveal').innerText.trim() === ''")
        votes = store.votes()
        assert {v["model_a"] for v in votes} | {v["model_b"] for v in votes} == {base, trained_id}
        assert [v["winner"] for v in votes] == ["model_a", "model_b", "tie", "model_a", "bothbad"]
        page.get_by_role("tab", name="Leaderboard").click()
        wait_shown(page, "#board-text", "95% CI")
        screenshot(page, tmp_path, "chat-e-arena-leaderboard.png")

        # the run's eval beside the served model, then Promote (confirmed: the tiny random-init models may differ
        # either way), and chat with the new model: no restart
        assert served_id(second) == (base, base)
        log_in(page, f"{second.url}admin/")
        shown_eval = wait_shown(page, "#train-eval", "95 % interval")
        assert f"Run #{run['id']}'s model (2nd) beside" in shown_eval and "instructions, strict" in shown_eval
        report = json.loads((Path(run["log_path"]).parent / "eval" / "eval.json").read_text())
        assert [str(Path(m["model"]).resolve()) for m in report["models"]] == [base, trained]
        page.locator("#served-run input").fill(str(run["id"]))
        page.locator("#promote-anyway input").check()
        page.locator("#promote").click()
        assert "Roll back returns to" in wait_shown(page, "#serving", f"promoted from run #{run['id']}")
        assert served_id(second) == (trained_id, trained_id)
        with pytest.raises(Exception, match="No arena is open now"):  # its pairing named the model served before
            arena.predict(api_name="/new_battle")
        arena.close()
        page.goto(second.url)
        wait_shown(page, "#model-line", trained_id)
        page.locator("#message textarea").fill("hello, who are you now?")
        page.locator("#send").click()
        wait_for_reply(page, 1)
        page.locator(BOT).last.hover()
        page.locator("#chatbot").get_by_label("Like", exact=True).last.click()
        wait_for(lambda: len(store.feedback()) == 21)
        assert store.feedback()[-1]["model"] == trained_id
        log_in(page, f"{second.url}admin/")
        page.locator("#rollback").click()
        wait_shown(page, "#serving", "rolled back")
        assert served_id(second) == (base, base)
        with pytest.raises(Exception, match="Nothing to roll back to"):
            client.predict(api_name="/rollback")

        # a run whose process dies (SIGKILL, as the OOM killer would) is shown failed with its exit status
        client.predict(*{**FORM, "method": "kto+sft", "launcher": "python", "nproc": 1, "sft_weight": 2.5}.values(),
                       api_name="/start")  # fmt: skip
        command = store.runs()[0]["settings"]["command"]  # KTO's trainer with its SFT term, on the KTO rows
        assert command[command.index("--loss") + 1] == "kto" and command[command.index("--sft_weight") + 1] == "2.5"
        os.killpg(store.runs()[0]["pid"], signal.SIGKILL)
        failed = wait_for(lambda: "**failed**" in (s := newest(client))["line"] and s)
        assert f"failed: exit status -{signal.SIGKILL.value}" in failed["line"]
        client.close()

        # Cancel during the evaluation before training, the run held there (tests/launched/stop_at_phase.py: a real
        # SIGSTOP once rank 0 announced it): "cancelling" from the click, then "cancelled", nothing to resume
        log_in(page, f"{second.url}admin/")
        fill_form(page, "python", steps=STEPS, lora=0, ranks=1, held_out=4, max_length=128)
        hold.touch()
        held = start_from_page(page, store)
        wait_shown(page, "#train-status", f"Run #{held['id']} (dpo): running — {EVAL_BEFORE}")
        wait_for(lambda: psutil.Process(held["pid"]).status() == psutil.STATUS_STOPPED)
        page.locator("#train-cancel").click()
        wait_shown(page, "#train-status", f"Run #{held['id']} (dpo): cancelling")
        signal_run(held["pid"], signal.SIGCONT)
        shown = wait_shown(page, "#train-status", f"Run #{held['id']} (dpo): cancelled")
        assert "cancelled before its first step: nothing to resume" in shown
        assert not hold.exists()

        # a run whose every prompt the max length cuts away: failed with the training's own line, not done
        fill_form(page, "python", max_length=32)
        cut = start_from_page(page, store)
        shown = wait_shown(page, "#train-status", f"Run #{cut['id']} (dpo): failed")
        assert "every prompt is at least max_length=32 tokens long: raise --max_length" in shown, shown


def fill_form(page, launcher: str, **fields) -> None:
    """Fill the Train page's form as an operator does: each number typed, then Tab (committed, as a user leaving the
    field), and the launcher chosen from its list."""
    for field, value in fields.items():
        box = page.locator(f"#train-{field.replace('_', '-')} input")
        box.fill(str(value))
        box.press("Tab")
    page.locator("#train-launcher input").click()
    page.get_by_role("option", name=launcher).click()
    assert page.locator("#train-launcher input").input_value() == launcher


def start_from_page(page, store: FeedbackStore) -> dict:
    """Click the Train page's Start; the run it started (newer than every run before)."""
    before = store.runs()[0]["id"]
    page.locator("#train-start").click()
    return wait_for(lambda: (r := store.runs()[0])["id"] > before and r["pid"] and r)
