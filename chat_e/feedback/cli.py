"""``chat-e feedback``: what Chat-E's users told it, as training rows, and the database's upkeep.

    chat-e feedback export --format dpo --out rows.jsonl      # recipes/preference.py --data_file rows.jsonl
    chat-e feedback export --format kto --out rows.jsonl      # recipes/preference.py --loss kto --data_file ...
    chat-e feedback export --format sft --out rows.jsonl      # recipes/blenderbot.py --train_file rows.jsonl
    chat-e feedback stats                                     # rows per kind
    chat-e feedback upgrade                                   # bring a shared database to the current schema
    chat-e feedback purge --older_than_days 90                # retention: delete older rows

``--feedback_db`` is the same SQLAlchemy URL ``chat-e`` and ``chat-e arena`` store to (default: the SQLite file in
``runs/chat-e``). The export rules are :mod:`chat_e.feedback.export`'s.
"""

from __future__ import annotations

import argparse
import datetime
import sys

from .export import FORMATS, export
from .store import DEFAULT_RUN_DIR, FeedbackStore, default_url


def add_db_argument(parser: argparse.ArgumentParser) -> None:
    """``--feedback_db``, as every Chat-E command that stores or reads feedback takes it."""
    parser.add_argument(
        "--feedback_db",
        "--feedback-db",
        default=None,
        metavar="URL",
        help=f"SQLAlchemy URL of the feedback database (e.g. postgresql://user@host/chat_e). Default: "
        f"{default_url(DEFAULT_RUN_DIR)} (SQLite, WAL).",
    )


DESCRIPTION = (
    "What Chat-E's users told it (thumbs, corrections, choices, arena votes), as training rows, and the feedback "
    "database's upkeep."
)


def add_feedback_commands(parser: argparse.ArgumentParser) -> None:
    """``chat-e feedback``'s subcommands (``export``, ``stats``, ``upgrade``, ``purge``) on ``parser``."""
    commands = parser.add_subparsers(dest="feedback_command", metavar="{export,stats,upgrade,purge}", required=True)
    out = commands.add_parser("export", help="Write training rows (JSON Lines) made from the feedback and votes.")
    out.add_argument(
        "--format", choices=FORMATS, required=True, help="dpo / kto: preference rows; sft: dialogue rows."
    )
    out.add_argument("--out", required=True, help="The .jsonl file to write (replaced all at once).")
    add_db_argument(out)
    for name, text in (("stats", "Count the stored rows per kind."), ("upgrade", "Upgrade the schema.")):
        add_db_argument(commands.add_parser(name, help=text))
    purge = commands.add_parser("purge", help="Delete rows older than a number of days (retention).")
    purge.add_argument("--older_than_days", "--older-than-days", type=float, required=True)
    add_db_argument(purge)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="chat-e feedback", description=DESCRIPTION)
    add_feedback_commands(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the parsed ``chat-e feedback`` command ``args``."""
    url = args.feedback_db or default_url()
    try:
        store = FeedbackStore(url)
    except Exception as err:
        print(f"chat-e feedback: error: cannot open the feedback database {url}: {err}", file=sys.stderr)
        return 2
    try:
        if args.feedback_command == "export":
            written, unused = export(store.feedback(), store.votes(), args.format, args.out)
            detail = ", ".join(f"{n} {why}" for why, n in sorted(unused.items())) or "nothing"
            print(f"Wrote {written} {args.format} rows to {args.out}; no row from: {detail}.")
        elif args.feedback_command == "stats":
            print(", ".join(f"{kind}: {n}" for kind, n in store.counts().items()) + f" ({store.describe()})")
        elif args.feedback_command == "upgrade":
            print(f"{store.describe()} is at the current schema.")
        elif args.feedback_command == "purge":
            deleted = store.purge(datetime.timedelta(days=args.older_than_days))
            print(f"Deleted {deleted} rows older than {args.older_than_days:g} days from {store.describe()}.")
    finally:
        store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
