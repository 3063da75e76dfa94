"""The operator's Train page (``chat-e serve --admin USER:PASSWORD``, served at ``/admin`` behind its own login; it
does not exist without ``--admin``): what the feedback database holds per format and why rows were dropped, a form
(method, steps, LoRA rank, learning rate, launcher, ranks, DeepSpeed preset; the base is the served model), Start,
Cancel and Resume, and while a run goes on its progress (step of steps, ETA), the loss and DPO's reward margin and
accuracy plotted, and the log's last lines; the runs table below. A :class:`chat_e.studio.runs.RunManager` does the
work; a refusal (a bad value, no rows, a run already running) is one line (:func:`refusal`, a notice that stays until
closed) and starts nothing.

Endpoints (gradio_client, logged in as the operator): ``/start`` (the form's values, in the form's order), ``/cancel``,
``/resume`` and ``/status`` (each takes nothing: the newest run), which give the status line, the progress bar's HTML,
the plotted points, the log lines, the runs table, the data summary and the newest done run's eval.
"""

from __future__ import annotations

import dataclasses
import html
import logging
import time
from typing import Any

from hf_ext.deepspeed.load import PRESETS

from ..data.limits import ChatLimits, Refused, check_request
from ..feedback.export import Examples
from ..training.progress import TRAINING
from ..web.ui import import_gradio, theme
from .runs import (
    APP_METHODS,
    METHOD_RUNS,
    PREFERRED_SUM,
    RunForm,
    RunManager,
    held_out_line,
    method_rows,
    share_text,
)
from .serving import ServingDesk

logger = logging.getLogger(__name__)

TITLE = "Chat-E · Train"
#: the form's fields, in the order of the page's inputs and of ``/start``'s values
FORM_FIELDS = tuple(field.name for field in dataclasses.fields(RunForm))
#: the runs table's columns
RUN_COLUMNS = ["run", "method", "status", "rows", "steps", "started", "ended", "prefers chosen before",
               "prefers chosen after"]  # fmt: skip
#: the training log's series plotted while a run goes on (TRL's implicit reward stays there: it is 0 before training
#: by construction, so it is no before/after)
SERIES = {"loss": "loss", "rewards/margins": "reward margin", "rewards/accuracies": "reward accuracy"}


def data_summary(store) -> str:
    """Rows each method trains on that the database holds now, with what made no row and why (Markdown)."""
    examples = Examples(store.feedback(), store.votes())
    lines = ["| method | rows | not used, and why |", "|---|---|---|"]
    for method in APP_METHODS:
        rows_format = METHOD_RUNS[method][1]
        rows = examples.rows(rows_format)
        why = examples.dropped + examples.unused(rows_format)
        reasons = ", ".join(f"{n} {reason}" for reason, n in why.most_common() if n) or "—"
        lines.append(f"| {method_rows(method)} | {len(rows)} | {reasons} |")
    return "\n".join(lines)


def runs_table(runs: list[dict[str, Any]]) -> list[list[Any]]:
    def accuracy(metrics):
        value = (metrics or {}).get(PREFERRED_SUM)
        return share_text(value) if value else ""

    return [
        [
            r["id"],
            r["method"],
            r["status"],
            r["rows"],
            r["settings"]["form"]["max_steps"],
            f"{r['started_at']:%Y-%m-%d %H:%M:%S}" if r["started_at"] else "",
            f"{r['ended_at']:%Y-%m-%d %H:%M:%S}" if r["ended_at"] else "",
            accuracy(r["metrics_before"]),
            accuracy(r["metrics_after"]),
        ]
        for r in runs
    ]


def status_view(manager: RunManager) -> tuple[str, str, list[list[Any]], str, list[list[Any]], str]:
    """The newest run's status line, progress bar (HTML), plotted points ``[step, value, series]``, last log lines,
    the runs table, and the newest done run's eval beside the model it was trained from."""
    runs = manager.refresh()
    if not runs:
        return "No run yet.", "", [], "", [], ""
    newest = runs[0]
    progress = manager.progress(newest["id"])
    step, total, eta = progress["step"], progress["max_steps"], progress["eta_s"]
    line = f"Run #{newest['id']} ({newest['method']}): **{newest['status']}**"
    if newest["status"] in ("running", "cancelling") and progress["phase"]:
        rows = f" ({progress['rows'][0]} of {progress['rows'][1]} replies scored)" if progress.get("rows") else ""
        line += f" — {progress['phase']}{rows} for {max(0.0, time.time() - progress['phase_since']):.0f} s"
    line += f", step {step} of {total}"
    if eta is not None and newest["status"] == "running" and progress["phase"] == TRAINING:
        line += f", about {eta:.0f} s left"
    split = progress["split"]
    if split:
        line += f" ({split['training_rows']} training rows, {split['held_out_rows']} held out)"
    if newest["status"] == "done" and newest["metrics_after"]:
        line += ". " + held_out_line(newest["metrics_before"] or {}, newest["metrics_after"])
    if newest["status"] in ("failed", "stopped", "cancelled") and newest["detail"]:
        line += f". {newest['detail'].splitlines()[0]}"
    bar = f'<progress value="{step}" max="{max(total, 1)}" style="width:100%"></progress>'
    points = [[s, float(v), SERIES[key]] for key, series in progress["series"].items() for s, v in series]
    log = "\n".join(progress["log_tail"])
    done = next((r for r in runs if r["status"] == "done"), None)
    return line, bar, points, log, runs_table(runs), manager.eval_markdown(done) if done else ""


def serving_view(desk: ServingDesk | None) -> str:
    """What is served, what a Roll back returns to, the arena's pair (Markdown)."""
    if desk is None:
        return ""
    now = desk.status()
    last = now["history"][-1]
    how = {
        "start": "since the server started",
        "promote": f"promoted from run #{last['run']}",
        "rollback": "rolled back to",
    }[last["action"]]
    lines = [f"**Serving** `{now['serving']}` ({how}, {last['at']:%Y-%m-%d %H:%M:%S} UTC)."]
    if now["previous"]:
        lines.append(f"Roll back returns to `{now['previous']}`.")
    if now["arena"]:
        lines.append(f"**Arena open** at [/arena/](/arena/): `{now['arena'][0]}` against `{now['arena'][1]}`, blind.")
    return "  \n".join(lines)


def refusal(gr, err: Exception | str):
    """What the operator's page says when it refuses or fails: one line, in a notice that stays until it is closed (a
    run's Start or Promote is refused while the operator may be looking elsewhere; a fading note would be missed)."""
    return gr.Error(str(err), duration=None, print_exception=False)


# long: a Blocks layout, in the page's order
def build_train_app(manager: RunManager, store, desk: ServingDesk | None = None, limits: ChatLimits | None = None):
    """The Train page's Blocks; with a ``desk``, its "Served model" section (arena, Promote, Roll back, side by
    side)."""
    gr = import_gradio()
    limits = limits or ChatLimits()
    import pandas as pd  # noqa: PLC0415 (optional extra: comes with gradio, like the page)

    defaults = RunForm()

    def points_frame(points):
        return pd.DataFrame(points or [], columns=["step", "value", "series"])

    def view():
        line, bar, points, log, table, evaluation = status_view(manager)
        return line, bar, points_frame(points), log, table, data_summary(store), evaluation

    #: the form's numbers: RunForm's field, read as a whole number or any number, under the field's name
    numbers = {
        "max_steps": (_int, "steps"),
        "lora_rank": (_int, "LoRA rank"),
        "learning_rate": (_float, "learning rate"),
        "nproc": (_int, "ranks"),
        "held_out": (_int, "held-out rows"),
        "batch": (_int, "batch"),
        "max_length": (_int, "max length"),
        "replay": (_int, "replay rows"),
        "sft_weight": (_float, "SFT weight"),
    }

    def start(*values):
        """The form's values, in RunForm's field order (the page's inputs are listed in it below)."""
        try:
            given = dict(zip(FORM_FIELDS, values, strict=True))
            form = RunForm(
                **{
                    name: numbers[name][0](value, numbers[name][1]) if name in numbers else value
                    for name, value in given.items()
                }
            )
            run_id = manager.start(form)
        except ValueError as err:
            raise refusal(gr, err) from None
        logger.info("training run #%d started: %s", run_id, form)
        return view()

    def act(action):
        def handler():
            runs = manager.refresh()
            try:
                if not runs:
                    raise ValueError("There is no run yet.")
                action(runs[0]["id"])
            except ValueError as err:
                raise refusal(gr, err) from None
            return view()

        return handler

    def whole(value, label: str, elem_id: str):
        """A field for a whole number."""
        return gr.Number(value, precision=0, label=label, elem_id=elem_id)

    with gr.Blocks(title=TITLE) as demo:
        gr.Markdown(f"# {TITLE}\nBase model: the served one, `{html.escape(manager.base_model)}`.")
        summary = gr.Markdown(data_summary(store), elem_id="train-data")
        with gr.Row():
            method = gr.Radio(list(APP_METHODS), value=defaults.method, label="method", elem_id="train-method")
            max_steps = whole(defaults.max_steps, "steps", "train-steps")
            lora_rank = whole(defaults.lora_rank, "LoRA rank (0: every weight)", "train-lora")
            learning_rate = gr.Number(defaults.learning_rate, label="learning rate")
        with gr.Row():
            launcher = gr.Dropdown(
                ["python", "torchrun", "deepspeed"],
                value=defaults.launcher,
                label="launcher",
                elem_id="train-launcher",
            )
            nproc = whole(defaults.nproc, "ranks", "train-ranks")
            preset = gr.Dropdown(["none", *PRESETS], value=defaults.preset, label="DeepSpeed preset")
        with gr.Row():
            held_out = whole(
                defaults.held_out, "held-out rows (whole sessions, for the before/after)", "train-held-out"
            )
            batch = whole(defaults.batch, "batch (rows per rank and step)", "train-batch")
            max_length = whole(defaults.max_length, "max length (tokens of prompt and reply)", "train-max-length")
            replay = whole(
                defaults.replay,
                "replay rows (make demo's chit-chat trained on beside the feedback, against forgetting; SFT and KTO)",
                "train-replay",
            )
            sft_weight = gr.Number(
                defaults.sft_weight,
                label="SFT weight (kto+sft: KTO's loss + this × the desirable replies' NLL per token)",
                elem_id="train-sft-weight",
            )
        with gr.Row():
            start_button = gr.Button("Start", variant="primary", elem_id="train-start")
            cancel_button = gr.Button("Cancel (save a checkpoint and stop)", elem_id="train-cancel")
            resume_button = gr.Button("Resume", elem_id="train-resume")
        status = gr.Markdown("No run yet.", elem_id="train-status")
        bar = gr.HTML("", elem_id="train-progress")
        plot = gr.LinePlot(
            points_frame([]), x="step", y="value", color="series", label="training curves", elem_id="train-plot"
        )
        log = gr.Textbox(label="last log lines", lines=10, max_lines=20, interactive=False, elem_id="train-log")
        table = gr.Dataframe(headers=RUN_COLUMNS, value=[], label="runs", interactive=False, elem_id="train-runs")
        evaluation = gr.Markdown("", elem_id="train-eval")
        outputs = [status, bar, plot, log, table, summary, evaluation]
        inputs = {
            "method": method,
            "max_steps": max_steps,
            "lora_rank": lora_rank,
            "learning_rate": learning_rate,
            "launcher": launcher,
            "nproc": nproc,
            "preset": preset,
            "held_out": held_out,
            "batch": batch,
            "max_length": max_length,
            "replay": replay,
            "sft_weight": sft_weight,
        }
        form = [inputs[name] for name in FORM_FIELDS]
        start_button.click(start, form, outputs, api_name="start")
        cancel_button.click(act(manager.cancel), None, outputs, api_name="cancel")
        resume_button.click(act(manager.resume), None, outputs, api_name="resume")
        refresh = gr.Button("Refresh", visible=False)
        refresh.click(view, None, outputs, api_name="status")
        gr.Timer(2.0).tick(
            view, None, outputs, api_name=False, show_progress="hidden"
        )  # every 2 s: each tick reads the database, the processes and the logs
        demo.load(view, None, outputs, api_name=False)
        if desk is not None:
            served_section(gr, desk, limits)
    demo.theme = theme()
    return demo


def served_section(gr, desk: ServingDesk, limits: ChatLimits) -> None:  # long: a Blocks layout, in the page's order
    """The Train page's "Served model" section: a finished run's model against the served one in the app's blind
    arena, Promote, Roll back, and both models' replies side by side (named). Endpoints: ``/open_arena`` (the run's
    number), ``/promote`` (the run's number, and whether to promote anyway), ``/rollback`` and ``/side_by_side`` (the
    run's number, a message)."""

    def run_number(value) -> int:
        number = _int(value, "run")
        if number < 1:
            raise ValueError(f"run={value!r}: give the number of a run that is done (the runs table's first column).")
        return number

    def acting(action):
        def handler(run, *flags):
            try:
                action(run_number(run), *flags)
            except ValueError as err:
                raise refusal(gr, err) from None
            return serving_view(desk)

        return handler

    def rollback():
        try:
            desk.rollback()
        except ValueError as err:
            raise refusal(gr, err) from None
        return serving_view(desk)

    def export_gguf(run):
        try:
            written = desk.export_gguf(run_number(run))
        except ValueError as err:
            raise refusal(gr, err) from None
        return "\n".join(f"- `{html.escape(str(path))}` ({path.stat().st_size / 1e6:.0f} MB)" for path in written)

    def side_by_side(run, message):
        try:
            number = run_number(run)
            checked = check_request(limits, message=message, ranges={})
        except (ValueError, Refused) as err:
            raise refusal(gr, err) from None
        try:
            replies = desk.side_by_side(number, checked)
        except ValueError as err:
            raise refusal(gr, err) from None
        except Exception:
            logger.exception("side by side: generation failed")
            raise refusal(gr, "A reply could not be generated; the server's log says why.") from None
        names = list(replies)
        return "\n\n".join(
            f"**{'served' if i == 0 else f'run #{number}'}** `{html.escape(name)}`:\n\n{html.escape(replies[name])}"
            for i, name in enumerate(names)
        )

    gr.Markdown(
        "## Served model\nCompare a finished run's model with the served one, then promote it (no restart: "
        "replies under way finish on the model they started on) or roll back."
    )
    serving = gr.Markdown(serving_view(desk), elem_id="serving")
    with gr.Row():
        run = gr.Number(None, precision=0, label="run (a done run's number)", elem_id="served-run")
        arena_button = gr.Button("Open a blind arena: served vs this run", elem_id="open-arena")
        promote_button = gr.Button("Promote this run's model", variant="primary", elem_id="promote")
        anyway = gr.Checkbox(
            False, label="promote anyway (its eval is missing, or says it is worse)", elem_id="promote-anyway"
        )
        rollback_button = gr.Button("Roll back", elem_id="rollback")
        gguf_button = gr.Button("Export GGUF (F16, Q8_0, Q4_K_M)", elem_id="export-gguf")
    exported = gr.Markdown(elem_id="gguf-files")
    with gr.Row():
        message = gr.Textbox(label="message for both (side by side, named)", scale=4, elem_id="side-message")
        compare = gr.Button("Side by side", scale=1, elem_id="side-by-side")
    replies = gr.Markdown(elem_id="side-replies")
    arena_button.click(acting(desk.open_arena), run, serving, api_name="open_arena")
    promote_button.click(acting(desk.promote), [run, anyway], serving, api_name="promote")
    rollback_button.click(rollback, None, serving, api_name="rollback")
    gguf_button.click(export_gguf, run, exported, api_name="export_gguf")
    compare.click(side_by_side, [run, message], replies, api_name="side_by_side")
    gr.Timer(2.0).tick(lambda: serving_view(desk), None, serving, api_name=False, show_progress="hidden")


def _int(value, name: str) -> int:
    if value is None or str(value).strip() == "":
        raise ValueError(f"{name} is empty: give a whole number.")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r}: give a whole number.") from None
    if number != int(number):
        raise ValueError(f"{name}={value!r}: give a whole number.")
    return int(number)


def _float(value, name: str) -> float:
    if value is None or str(value).strip() == "":
        raise ValueError(f"{name} is empty: give a number.")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r}: give a number.") from None
