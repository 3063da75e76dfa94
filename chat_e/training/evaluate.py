"""``chat-e eval --model DIR [--model DIR2]``: an offline adherence report of one model, or of two side by side.

    chat-e eval --model runs/demo                                   # one model
    chat-e eval --model runs/models/smollm2 --model runs/demo       # before and after: paired differences

No judge model and no Hub: every score is a rule (:mod:`chat_e.data.adherence`) or the model's own probabilities.

* **mode adherence**: for each Chat-E mode (persona, emotion, domain, topic), probes whose answer a rule can check
  (the persona's name or hobby asked back, the domain or topic kept, the emotion acknowledged); the share per mode;
* **verifiable instructions** in the IFEval manner (word limits, no commas, lower case, a keyword, bullets, JSON, an
  ending, ...): strict and loose accuracy per prompt;
* **human-reply NLL** per token (each row's, averaged over the rows) on held-out human chit-chat (the validation split
  ``make demo`` evaluates, never trained on), the model's own probabilities
  (:func:`chat_e.training.heldout.reply_logprobs`);
* **replies**: their length in words, distinct-2, and the shares of empty and runaway replies.

Replies are generated as Chat-E serves them (the same prompt rendering, the model's generation defaults, ``--quantize
auto``: int8 for fp32 weights) but greedy, one beam, batched (hf-ext's ``generate_in_order``), so that a rerun gives
the same replies. Each share comes with Wilson's 95 % interval; with two models each score's paired difference (the
second minus the first) with a paired-bootstrap 95 % interval, and McNemar's exact p-value for the pass/fail scores
(:mod:`chat_e.data.stats`). Written to OUTPUT_DIR: ``eval.json`` (every reply and score), ``eval.md`` (the table) and
``eval.png`` (the shares with their intervals).
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import time
from pathlib import Path

import torch

from hf_ext.atomic import write_bytes_atomically, write_text_atomically
from hf_ext.evaluation.bleu import generate_in_order

from ..data import adherence
from ..data.corpora import OFFLINE_DATASETS, load_offline, sample
from ..data.dialogue import encode_example
from ..data.limits import Request
from ..data.settings import resolve_quantize
from ..data.stats import paired_difference, share_of
from ..engines.local import LocalEngine
from .eval_cli import DESCRIPTION, add_eval_arguments, check
from .heldout import reply_logprobs

logger = logging.getLogger(__name__)

#: the scores compared between two models: (key, label, higher is better)
SCORES = (
    ("mode", "mode adherence", True),
    ("instruction_strict", "instructions (strict)", True),
    ("instruction_loose", "instructions (loose)", True),
    ("nll", "human-reply NLL/token", False),
    ("words", "reply length (words)", None),
    ("runaway", "runaway replies", False),
    ("empty", "empty replies", False),
)


def probe_inputs(engine: LocalEngine) -> list[dict]:
    """Every probe's model input, as Chat-E renders a first message: the instruction prompts in free chat, then the
    mode probes under their mode and context."""
    chats = [Request(p.message) for p in adherence.PROMPTS]
    chats += [Request(p.message, mode=p.mode, context=p.context) for p in adherence.MODE_PROBES]
    return [{"input_ids": engine.encode(chat)} for chat in chats]


def human_rows(engine: LocalEngine, args) -> list[tuple[list[int], list[int]]]:
    """(prompt, human reply) ids of ``--n_nll`` validation rows of ``--dataset``, encoded as the recipe trains."""
    rows = sample(load_offline(args.dataset, seed=args.seed)["validation"], args.n_nll, args.seed)
    out = []
    for row in rows:
        example = encode_example(
            engine.tokenizer,
            row["texts"],
            row["labels"],
            args.max_source_length,
            args.max_target_length,
            engine.family,
        )
        if engine.family == "causal":
            first = next(i for i, label in enumerate(example["labels"]) if label >= 0)
            out.append((example["input_ids"][:first], example["input_ids"][first:]))
        else:
            out.append((example["input_ids"], example["labels"]))
    return out


def evaluate_model(path: str, args) -> dict:
    """Every reply and score of the model in ``path``."""
    started = time.perf_counter()
    engine = LocalEngine.from_pretrained(path, quantize=resolve_quantize(args.quantize, "fp32"))
    tokenizer = engine.tokenizer
    gen_kwargs = {"max_new_tokens": args.max_new_tokens, "do_sample": False, "num_beams": 1}
    with torch.no_grad():
        replies, lengths, _ = generate_in_order(
            engine.model, tokenizer, probe_inputs(engine), gen_kwargs, args.batch_size
        )
    generated = time.perf_counter() - started
    n_prompts = len(adherence.PROMPTS)
    instructions = adherence.score_instructions(replies[:n_prompts])
    modes = adherence.score_modes(replies[n_prompts:])
    hit = [n >= args.max_new_tokens for n in lengths]
    stats = adherence.reply_stats(replies, hit)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    table = reply_logprobs(engine.model, human_rows(engine, args), args.batch_size, pad)
    nll_rows = (-table[:, 0] / table[:, 1].clamp(min=1)).tolist()
    items = {
        "mode": [float(p["passed"]) for p in modes["probes"]],
        "instruction_strict": [float(p["strict"]) for p in instructions["prompts"]],
        "instruction_loose": [float(p["loose"]) for p in instructions["prompts"]],
        "nll": nll_rows,
        "words": [float(len(r.split())) for r in replies],
        "runaway": [float(adherence.is_runaway(r, h)) for r, h in zip(replies, hit)],
        "empty": [float(not r.strip()) for r in replies],
    }
    return {
        "model": path,
        "engine": engine.describe(),
        "seconds": {"generation": generated, "total": time.perf_counter() - started},
        "shares": {
            "mode": share_of(items["mode"]).as_dict(),
            **{f"mode:{m}": share_of(flags).as_dict() for m, flags in _by_mode(modes["probes"]).items()},
            "instruction_strict": share_of(items["instruction_strict"]).as_dict(),
            "instruction_loose": share_of(items["instruction_loose"]).as_dict(),
            "runaway": share_of(items["runaway"]).as_dict(),
            "empty": share_of(items["empty"]).as_dict(),
        },
        "nll": sum(nll_rows) / len(nll_rows),  # each row's NLL/token, averaged: the paired difference's unit
        "nll_rows": len(nll_rows),
        "words": stats["mean_words"],
        "distinct_2": stats["distinct_2"],
        "instructions": instructions,
        "modes": modes,
        "items": items,
        "replies": replies,
    }


def _by_mode(probes: list[dict]) -> dict[str, list[bool]]:
    out: dict[str, list[bool]] = {}
    for probe in probes:
        out.setdefault(probe["mode"], []).append(bool(probe["passed"]))
    return out


def compare(old: dict, new: dict) -> dict:
    """Each score's paired difference, ``new`` minus ``old``, on the same items."""
    return {key: paired_difference(old["items"][key], new["items"][key]).as_dict() for key, _, _ in SCORES}


def worse_beyond_interval(differences: dict) -> list[str]:
    """The scores on which the second model is worse than the first beyond the 95 % interval."""
    worse = []
    for key, label, higher_is_better in SCORES:
        d = differences.get(key)
        if higher_is_better is None or not d or d["low"] is None:
            continue
        if (higher_is_better and d["high"] < 0) or (not higher_is_better and d["low"] > 0):
            worse.append(label)
    return worse


def _pct(value: dict) -> str:
    return "—" if value["rate"] is None else f"{value['rate']:.1%} [{value['low']:.1%}, {value['high']:.1%}]"


def markdown(results: list[dict], differences: dict | None) -> str:
    """The report's table: one column per model (and the paired difference with two)."""
    names = [Path(r["model"]).name or r["model"] for r in results]
    head = ["score", *names] + (["difference (2nd − 1st), 95 % CI", "p (McNemar)"] if differences else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    share_rows = [("mode", "mode adherence (all modes)")]
    share_rows += [(k, f"  {k.split(':')[1]}") for k in results[0]["shares"] if k.startswith("mode:")]
    share_rows += [
        ("instruction_strict", "instructions, strict"),
        ("instruction_loose", "instructions, loose"),
        ("runaway", "runaway replies"),
        ("empty", "empty replies"),
    ]
    for key, label in share_rows:
        cells = [_pct(r["shares"][key]) + f" (n={r['shares'][key]['n']})" for r in results]
        lines.append("| " + " | ".join([label, *cells, *_diff_cells(differences, key)]) + " |")
    for key, label in (("nll", "human-reply NLL/token"), ("words", "reply length (words)")):
        cells = [_num(r[key]) for r in results]
        lines.append("| " + " | ".join([label, *cells, *_diff_cells(differences, key)]) + " |")
    cells = [_num(r["distinct_2"]) for r in results]
    lines.append("| " + " | ".join(["distinct-2", *cells, *([""] * 2 if differences else [])]) + " |")
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def _diff_cells(differences: dict | None, key: str) -> list[str]:
    if not differences:
        return []
    d = differences.get(key)
    if not d or d["diff"] is None:
        return ["", ""]
    percent = key not in ("nll", "words")
    fmt = (lambda x: f"{x * 100:+.1f} pts") if percent else (lambda x: f"{x:+.3f}")
    p = "" if d["p_value"] is None else f"{d['p_value']:.3g}"
    return [f"{fmt(d['diff'])} [{fmt(d['low'])}, {fmt(d['high'])}]", p]


def plot(results: list[dict], path: Path) -> None:
    """The shares per model with their 95 % intervals, as a grouped bar chart."""
    import matplotlib  # noqa: PLC0415 (optional extra: app)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415 (optional extra: app)

    keys = [k for k in results[0]["shares"] if k.startswith("mode")] + ["instruction_strict", "instruction_loose"]
    fig, ax = plt.subplots(figsize=(1.1 * len(keys) + 2, 3.8))
    width = 0.8 / len(results)
    for i, result in enumerate(results):
        rates = [result["shares"][k]["rate"] or 0 for k in keys]
        errors = [
            [r - (result["shares"][k]["low"] or 0) for r, k in zip(rates, keys)],
            [(result["shares"][k]["high"] or 0) - r for r, k in zip(rates, keys)],
        ]
        xs = [x + (i - (len(results) - 1) / 2) * width for x in range(len(keys))]
        ax.bar(xs, rates, width, yerr=errors, capsize=3, label=Path(result["model"]).name or result["model"])
    ax.set_xticks(
        range(len(keys)), [k.replace("instruction_", "instr. ").replace("mode:", "") for k in keys], rotation=20
    )
    ax.set_ylim(0, 1)
    ax.set_ylabel("share (95 % CI)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    write_bytes_atomically(path, png.getvalue())


def run_eval(args) -> dict:
    """Evaluate ``args.model`` (one or two), write the report, and return it."""
    if args.dataset not in OFFLINE_DATASETS:
        raise SystemExit(f"chat-e eval: --dataset {args.dataset!r}: choose one of {', '.join(OFFLINE_DATASETS)}.")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for path in args.model:
        logger.info("chat-e eval: %s", path)
        results.append(evaluate_model(path, args))
    differences = compare(*results) if len(results) == 2 else None
    report = {
        "models": results,
        "differences": differences,
        "worse": worse_beyond_interval(differences) if differences else [],
        "settings": {k: v for k, v in vars(args).items() if not callable(v) and k != "command_parser"},
    }
    table = markdown(results, differences)
    write_text_atomically(out / "eval.json", json.dumps(report, indent=1, default=str) + "\n")
    write_text_atomically(out / "eval.md", table + "\n")
    plot(results, out / "eval.png")
    print(table)
    if report["worse"]:
        print(f"\nThe second model is worse beyond the 95 % interval on: {', '.join(report['worse'])}.")
    print(f"\nReport: {out / 'eval.json'}, {out / 'eval.md'}, {out / 'eval.png'}")
    return report


def main(argv: list[str] | None = None) -> dict:
    """``python -m chat_e.training.evaluate FLAGS`` (what ``chat-e eval FLAGS`` runs)."""
    parser = argparse.ArgumentParser(prog="chat-e eval", description=DESCRIPTION)
    add_eval_arguments(parser)
    args = parser.parse_args(argv)
    check(args, parser)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    return run_eval(args)


if __name__ == "__main__":
    main()
