"""``chat-e train``: Chat-E's training, installed, under the launcher of your choice.

    chat-e train --method sft --nproc 2 -- --config recipes/configs/tiny.yaml --output_dir runs/tiny
    chat-e train --method dpo --launcher deepspeed --nproc 2 -- --data_file dpo.jsonl --output_dir runs/dpo
    chat-e train --method kto -- --help        # the training's own flags

``--method`` picks the training (``sft``: :mod:`chat_e.training.dialogue`, what ``recipes/blenderbot.py`` runs;
``dpo`` / ``kto``: :mod:`chat_e.training.preference` with that loss); everything after ``--`` is that training's own
flags. The launcher starts ``--nproc`` ranks of it as a module (``torchrun -m``, ``deepspeed --module``, or one plain
``python -m``): the same processes the recipe scripts get, so every hf-ext feature (presets, preemption, resume on
any number of ranks) is there. ``chat-e train`` becomes the launcher (``exec``): its exit status and the signals it
gets are the launcher's.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from pathlib import Path

#: each method's training module, and the flags it adds to the user's
METHODS = {
    "sft": ("chat_e.training.dialogue", []),
    "dpo": ("chat_e.training.preference", ["--loss", "dpo"]),
    "kto": ("chat_e.training.preference", ["--loss", "kto"]),
}
LAUNCHERS = ("torchrun", "deepspeed", "python")
#: the held-out report's keys (chat_e.training.heldout writes them, the app's Train page reads them): the shares of
#: pairs whose preferred reply the model finds likelier, summed and per token, and the preferred replies' NLL/token
PREFERRED_SUM, PREFERRED_PER_TOKEN, REPLY_NLL = "preferred_sum", "preferred_per_token", "reply_nll"
#: the report the preference training writes when it finished (its before/after), in its output dir
PREFERENCE_REPORT = "preference_metrics.json"
#: how the training says why it stopped early, in one line of its log (the app's Train page shows that line)
STOP_MARK = "chat-e training stopped: "


def stop(reason: str) -> SystemExit:
    """The exception that ends a training with ``reason`` as its one line (exit status 1): ``raise stop(...)``."""
    return SystemExit(STOP_MARK + reason)


def replay_problem(loss: str, loss_types: list[str], replay: int) -> str | None:
    """Why ``replay`` rows cannot join a ``loss`` run with DPO's ``loss_types``, in one line; None when they can. A
    replayed row has a human reply and no worse one: KTO takes it as desirable, DPO learns from it only through an
    SFT term."""
    if replay < 0:
        return f"replay={replay}: give 0 (none) or a number of rows to replay."
    if replay and loss == "dpo" and "sft" not in loss_types:
        return (
            f"replay={replay} with DPO's loss {' + '.join(loss_types)}: a replayed row has no worse reply, so only "
            "an SFT term learns from it; train SFT or KTO, or add sft to --loss_type."
        )
    return None


DESCRIPTION = (
    "Train a model with Chat-E's installed training: dialogue fine-tuning (sft) or preference tuning (dpo, kto), "
    "under torchrun, DeepSpeed's launcher or one plain process. The training's own flags follow '--'."
)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """``chat-e train``'s flags on ``parser``."""
    parser.add_argument("--method", choices=tuple(METHODS), required=True, help="sft, dpo or kto.")
    parser.add_argument(
        "--launcher", choices=LAUNCHERS, default="torchrun", help="How the ranks are started (default torchrun)."
    )
    parser.add_argument("--nproc", type=int, default=1, help="Ranks on this machine (default 1).")
    parser.add_argument(
        "--master_port",
        "--master-port",
        type=int,
        default=None,
        help="The ranks' rendezvous port (default: the launcher's).",
    )
    parser.add_argument(
        "training_args", nargs=argparse.REMAINDER, metavar="-- FLAGS", help="The training's own flags, after '--'."
    )


def executable(name: str) -> str:
    """``name``'s path: beside this Python (its environment's ``bin``), else on ``PATH``."""
    beside = Path(sys.executable).parent / name
    if beside.is_file():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise FileNotFoundError(f"{name} is not installed beside {sys.executable} nor on PATH")
    return found


def command(
    method: str, launcher: str, nproc: int, training_args: list[str], master_port: int | None = None
) -> list[str]:
    """The command ``chat-e train`` runs."""
    if nproc < 1:
        raise ValueError(f"--nproc must be at least 1, not {nproc}.")
    if launcher == "python" and nproc != 1:
        raise ValueError("--launcher python starts one process: use --nproc 1, or torchrun / deepspeed for more.")
    module, flags = METHODS[method]
    args = training_args[1:] if training_args[:1] == ["--"] else training_args
    if launcher == "python":
        return [sys.executable, "-m", module, *args, *flags]
    port = ["--master_port", str(master_port)] if master_port else []
    if launcher == "torchrun":
        return [executable("torchrun"), "--nproc_per_node", str(nproc), *port, "-m", module, *args, *flags]
    return [executable("deepspeed"), "--num_gpus", str(nproc), *port, "--module", module, *args, *flags]


def run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Replace this process with the launcher of the parsed ``chat-e train`` ``args``."""
    try:
        cmd = command(args.method, args.launcher, args.nproc, list(args.training_args), args.master_port)
    except (ValueError, FileNotFoundError) as err:
        parser.error(str(err))
    print(f"chat-e train: {' '.join(cmd)}", file=sys.stderr, flush=True)
    os.execv(cmd[0], cmd)
    return 0  # not reached: exec does not return
