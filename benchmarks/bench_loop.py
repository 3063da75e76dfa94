"""What Chat-E's feedback loop buys, measured end to end with simulated users (benchmarks/simulated_users.py).

One ``chat-e serve --admin`` server of ``--model`` (``runs/demo`` by default: ``make demo``'s model, served with its
own generation defaults) and a seeded population of ``--users`` scripted users, each with a persona and one checkable
preference (short replies that end with a question and, asked, say the persona's name or hobby):

1. **Feedback**: every user chats through the chat UI (``gradio_client``), ``--messages`` first messages each:
   thumbs, corrections built by rule, a choice after Regenerate on every other message.
2. **Training**: a run started through the Train page's API (``/admin/``, ``/start``: ``--method``, ``--steps``,
   LoRA rank ``--lora_rank``, ``--learning_rate``, kto+sft's ``--sft_weight``, torchrun with ``--nproc`` ranks), its
   honest held-out before/after (the model's own preference on sessions it never trained on), then the page's eval of
   the run's model beside the served one (``chat-e eval``: verifiable instructions, the human-reply NLL, mode
   adherence; paired 95 % intervals).
3. **Blind votes**: the operator opens the app's arena between the served model and the run's (``/open_arena``);
   every user sends ``--votes`` messages none of them used for feedback and votes by their preference.

Reported: the feedback rows; the preference's satisfaction on the held-out messages for the old and the new model
(the arena's replies, paired by battle: the difference with its paired-bootstrap 95 % interval and McNemar's p); the
new model's arena win rate with its Wilson 95 % interval; the eval's instruction score and human-reply NLL (forgetting),
each with its paired interval.

    make demo
    python -m benchmarks.bench_loop --out runs/bench/loop.json --doc docs/benchmarks.md
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import astuple
from pathlib import Path

from benchmarks import harness
from benchmarks.bench_api import Server
from benchmarks.simulated_users import HELD_OUT_MESSAGES, give_feedback, population, satisfies, vote_in_arena
from chat_e.data.stats import paired_difference, share
from chat_e.feedback.leaderboard import two_model_summary
from chat_e.feedback.store import DONE, RUNNING, FeedbackStore
from chat_e.studio.runs import APP_METHODS, SFT_TERM_METHOD, RunForm, RunManager, share_text
from hf_ext.runtime import usable_cores

ADMIN = ("operator", "bench-only-password")


def wait_for_run(store: FeedbackStore, page, run_id: int, timeout: float = 7200) -> dict:
    """Until run ``run_id`` is over and its eval is written (the page settles and starts it); its record."""
    manager = RunManager(store, "", "")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        page.predict(api_name="/status")
        record = store.run(run_id)
        if record["status"] not in (RUNNING, "queued") and (
            record["status"] != DONE or manager.eval_state(record) in ("done", "failed")
        ):
            return record
        time.sleep(5)
    raise TimeoutError(f"run #{run_id} did not end (with its eval) within {timeout:.0f} s")


def held_out_satisfaction(votes: list[dict], users: dict[str, object], old: str, new: str) -> tuple[list, list]:
    """Per battle, whether the old and the new model's reply met the voter's preference (0/1, paired)."""
    messages = {m.text: m for m in HELD_OUT_MESSAGES}
    old_met, new_met = [], []
    for vote in votes:
        user, message = users[vote["context"]], messages[vote["message"]]
        replies = {vote["model_a"]: vote["reply_a"], vote["model_b"]: vote["reply_b"]}
        old_met.append(float(satisfies(user, message, replies[old])))
        new_met.append(float(satisfies(user, message, replies[new])))
    return old_met, new_met


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    harness.add_served_model_argument(parser)
    parser.add_argument("--users", type=int, default=24, help="Simulated users (default 24).")
    parser.add_argument("--messages", type=int, default=4, help="Feedback messages per user (default 4).")
    parser.add_argument("--votes", type=int, default=4, help="Blind arena battles per user (default 4).")
    parser.add_argument("--max_rows", type=int, default=200, help="Refuse a population giving more feedback rows.")
    parser.add_argument("--method", default="dpo", choices=APP_METHODS, help="The Train page's method.")
    parser.add_argument("--steps", type=int, default=30, help="The run's steps (default 30).")
    parser.add_argument("--lora_rank", type=int, default=16, help="The run's LoRA rank (default 16).")
    parser.add_argument("--learning_rate", type=float, default=5e-4, help="The run's learning rate (default 5e-4).")
    parser.add_argument("--nproc", type=int, default=2, help="The run's ranks under torchrun (default 2).")
    parser.add_argument("--held_out", type=int, default=24, help="The run's held-out rows (default 24).")
    parser.add_argument(
        "--replay", type=int, default=0, help="The run's replay rows of make demo's corpus (default 0)."
    )
    parser.add_argument("--sft_weight", type=float, default=1.0, help="kto+sft's SFT weight (default 1).")
    parser.add_argument("--seed", type=int, default=0, help="The population's and their choices' seed.")
    parser.add_argument("--eval_args", nargs="*", default=[], help="Flags of the Train page's chat-e eval.")
    parser.add_argument(
        "--train_args",
        default="",
        help="Flags every Train-page run gets before the form's (chat-e serve --train_args), such as "
        "--train_args='--undesirable_weight 0.5'.",
    )
    harness.add_publish_arguments(parser, out="runs/bench/loop.json", section="loop")
    args = parser.parse_args(argv)
    model = harness.served_model(parser, args)
    from gradio_client import Client  # noqa: PLC0415 (the app extra)

    users = population(args.users, args.seed)
    form = RunForm(method=args.method, max_steps=args.steps, lora_rank=args.lora_rank, learning_rate=args.learning_rate,
                   launcher="torchrun", nproc=args.nproc, held_out=args.held_out, max_length=192,
                   replay=args.replay, sft_weight=args.sft_weight)  # fmt: skip
    report: dict = {"users": args.users, "messages_per_user": args.messages, "votes_per_user": args.votes,
                    "seed": args.seed}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="bench-loop-") as tmp:
        tmp = Path(tmp)
        extra = [
            # PyTorch with int8, as every run of docs/benchmarks.md's section served it: the runs stay comparable
            "--engine",
            "torch",
            "--admin",
            ":".join(ADMIN),
            "--train_dir",
            str(tmp / "train"),
            "--eval_args",
            " ".join(args.eval_args),
            "--train_args",
            args.train_args,
        ]
        server = Server(model, tmp / "chat-e.log", threads=max(1, usable_cores() // 2), new_tokens=None, extra=extra)
        store = FeedbackStore(f"sqlite:///{(tmp / 'chat-e.log').with_suffix('.feedback.db')}")
        try:
            server.wait_ready()
            started = time.perf_counter()
            sent = give_feedback(server.url, users, args.messages, args.seed)
            report["feedback_seconds"] = round(time.perf_counter() - started, 1)
            rows = len(store.feedback())
            if rows > args.max_rows:
                raise SystemExit(
                    f"{rows} feedback rows, more than --max_rows {args.max_rows}: fewer users or messages."
                )
            report["feedback_rows"] = rows
            report["feedback_kinds"] = {
                k: sum(1 for s in sent if s["kind"] == k) for k in ("rating", "edit", "choice")
            }
            report["served_satisfied_while_feedback"] = share(
                sum(1 for s in sent if s["kind"] == "rating" and s["rating"] > 0), report["feedback_kinds"]["rating"]
            ).as_dict()

            page = Client(f"{server.url}admin/", auth=ADMIN, verbose=False, analytics_enabled=False, ssl_verify=False)
            page.predict(*astuple(form), api_name="/start")  # the page's fields, in the form's order
            run_id = store.runs()[0]["id"]
            record = wait_for_run(store, page, run_id)
            if record["status"] != DONE:
                raise RuntimeError(f"the Train page's run ended {record['status']}: {record['detail']}")
            evaluation = json.loads((Path(record["log_path"]).parent / "eval" / "eval.json").read_text())
            report["run"] = {
                "id": run_id, "rows": record["rows"], "steps": args.steps, "method": args.method,
                "lora_rank": args.lora_rank, "learning_rate": args.learning_rate, "replay": args.replay,
                "sft_weight": args.sft_weight if args.method == SFT_TERM_METHOD else None,
                "train_args": args.train_args,
                "wall_s": round((record["ended_at"] - record["started_at"]).total_seconds(), 1),
                "held_out_before": record["metrics_before"], "held_out_after": record["metrics_after"],
            }  # fmt: skip
            report["eval"] = {"differences": evaluation["differences"], "worse": evaluation["worse"],
                              "shares": [m["shares"] for m in evaluation["models"]],
                              "nll": [m["nll"] for m in evaluation["models"]]}  # fmt: skip

            page.predict(run_id, api_name="/open_arena")
            old, new = store_pair(server)
            page.close()
            started = time.perf_counter()
            report["votes_cast"] = vote_in_arena(server.url, users, args.votes, args.seed + 1)
            report["vote_seconds"] = round(time.perf_counter() - started, 1)
            votes = store.votes()
            by_persona = {u.persona: u for u in users}
            old_met, new_met = held_out_satisfaction(votes, by_persona, old, new)
            report["satisfaction"] = paired_difference(old_met, new_met).as_dict()
            summary = two_model_summary(votes, new, old)
            report["arena"] = {"wins": summary.wins, "losses": summary.losses, "ties": summary.ties,
                               "bothbad": summary.bothbad, "win_rate": share(summary.wins, summary.decisive).as_dict(),
                               "p_value": summary.p_value}  # fmt: skip
            report["models"] = {"old": old, "new": new}
        finally:
            server.stop()
            store.close()
    return harness.publish("benchmarks.bench_loop", argv, tables(report, args), report, args)


def store_pair(server: Server) -> tuple[str, str]:
    """The arena's pair as the server logged it when the operator opened it: (served, the run's)."""
    for line in reversed(server.log().splitlines()):
        if "arena opened: " in line:
            served, run = line.split("arena opened: ", 1)[1].split(" against ")
            return served.strip(), run.strip()
    raise RuntimeError("the server logged no opened arena")


def tables(report: dict, args) -> list[str]:
    """The bench's Markdown: what was done, then the before/after table."""
    sat, arena, ev, run = report["satisfaction"], report["arena"], report["eval"], report["run"]

    def pts(d: dict) -> str:
        return f"{d['diff'] * 100:+.1f} pts [{d['low'] * 100:+.1f}, {d['high'] * 100:+.1f}]"

    def rate(x: float) -> str:
        return f"{x:.1%}"

    instr, nll = ev["differences"]["instruction_strict"], ev["differences"]["nll"]
    rows = [
        ["preference met on held-out messages (arena replies, paired)", rate(sat["old"]), rate(sat["new"]), pts(sat)
         + f", McNemar p = {sat['p_value']:.3g}"],
        ["arena: the new model's win rate (decisive votes)", "", share_text(arena["win_rate"]),
         f"{arena['ties']} ties, {arena['bothbad']} both bad"],
        ["verifiable instructions, strict (chat-e eval)", rate(instr["old"]), rate(instr["new"]), pts(instr)],
        ["human-reply NLL/token (chat-e eval)", f"{nll['old']:.3f}", f"{nll['new']:.3f}",
         f"{nll['diff']:+.3f} [{nll['low']:+.3f}, {nll['high']:+.3f}]"],
        ["held-out sessions: prefers chosen, summed (the run's own)", share_text(run["held_out_before"].get(
            "preferred_sum")), share_text(run["held_out_after"].get("preferred_sum")), ""],
    ]  # fmt: skip
    replayed = f", {run['replay']} replayed rows of make demo's corpus" if run.get("replay") else ""
    if run.get("sft_weight") is not None:
        replayed += f", SFT weight {run['sft_weight']:g}"
    if run.get("train_args"):
        replayed += f", `{run['train_args']}`"
    note = (
        f"{report['users']} simulated users, {report['messages_per_user']} feedback messages each: "
        f"**{report['feedback_rows']} feedback rows** ({report['feedback_kinds']}; the served model met the preference "
        f"on {share_text(report['served_satisfied_while_feedback'])} of those replies), then the Train page's "
        f"{run['method'].upper()} run ({run['rows']} rows exported, {run['steps']} steps, LoRA rank {run['lora_rank']}, "
        f"lr {run['learning_rate']}{replayed}, {args.nproc} ranks: {run['wall_s']:.0f} s), then {len(report['votes_cast'])} "
        f"blind battles on {len(HELD_OUT_MESSAGES)} messages never used for feedback. Scores the eval says are worse "
        f"beyond the interval: {', '.join(ev['worse']) or 'none'}."
    )
    table = harness.markdown_table(["measure", "served (old)", "run's model (new)", "difference, 95 % CI"], rows)
    return [note, table]


if __name__ == "__main__":
    main()
