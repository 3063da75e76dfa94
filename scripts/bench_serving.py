"""Chat-E serving latency on CPU: fp32 vs bf16 vs int8 (dynamic quantization of the Linear layers).

Every variant answers the same prompts in the same run, interleaved (prompt by prompt, variant by variant) so that
background load hits them alike. Each reply is forced to the same length (min_new_tokens = max_new_tokens), so the
latencies compare equal work. Reports p50 / p95 reply latency, p50 time to the first streamed piece, tokens/s, the
ratio to fp32, and how often a variant's greedy reply equals fp32's.

    python scripts/bench_serving.py --size small --out runs/bench/chat_e_serving.json
    python scripts/bench_serving.py --model runs/demo/final --out runs/bench/chat_e_demo.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from app.engine import ChatEngine  # noqa: E402

VARIANTS = {"fp32": dict(dtype="fp32"), "bf16": dict(dtype="bf16"), "int8": dict(quantize="int8")}
PROMPTS = [
    ("Hi! What's your name?", [], "persona", "My name is Chat-E. I'm helpful, creative, clever and very friendly."),
    ("I finally got the job!", [], "emotion", "happy"),
    ("Where should I go in July?", ["I want a break.", "Where to?"], "domain", "vacation ideas"),
    ("Do you like movies?", ["hello", "hi, how are you?", "good, thanks"], "none", None),
    ("My dog is sick and I'm worried.", [], "emotion", "sad"),
    ("Can you recommend a book?", ["I read a lot.", "What do you read?"], "persona", "I love science fiction."),
    ("What is the capital of France?", [], "none", None),
    ("Any tips for cheap flights?", ["We fly next week."], "domain", "travel"),
]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="A model directory; default: build a random-init one of --size.")
    parser.add_argument("--size", default="small", choices=("tiny", "small", "400m"))
    parser.add_argument("--out", required=True, help="Where to write the JSON results.")
    parser.add_argument("--repeats", type=int, default=3, help="Passes over the prompts (default 3).")
    parser.add_argument("--num_beams", type=int, default=1)
    parser.add_argument("--new_tokens", type=int, default=32, help="Every reply is exactly this long.")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: one reply per core).")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

    tmp = None
    model_dir = args.model
    if model_dir is None:
        from hf_ext.tiny_model import build

        tmp = tempfile.TemporaryDirectory()
        model_dir = str(build(str(Path(tmp.name) / args.size), args.size, seed=0))

    engines = {name: ChatEngine.from_pretrained(model_dir, **kw) for name, kw in VARIANTS.items()}
    settings = (
        engines["fp32"]
        .default_settings()
        .replace(
            num_beams=args.num_beams, do_sample=False, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens
        )
    )
    for engine in engines.values():  # warm-up
        engine.chat(*PROMPTS[0], settings)

    latency = {name: [] for name in engines}
    first = {name: [] for name in engines}
    replies = {name: [] for name in engines}
    for _ in range(args.repeats):
        for prompt in PROMPTS:
            for name, engine in engines.items():
                start = time.perf_counter()
                replies[name].append(engine.chat(*prompt, settings))
                latency[name].append(time.perf_counter() - start)
                if settings.num_beams == 1:
                    start = time.perf_counter()
                    stream = engine.stream_chat(*prompt, settings)
                    next(stream)
                    first[name].append(time.perf_counter() - start)
                    stream.close()

    base_p50 = statistics.median(latency["fp32"])
    results = {}
    for name in engines:
        p50 = statistics.median(latency[name])
        results[name] = {
            "p50_s": round(p50, 4),
            "p95_s": round(percentile(latency[name], 0.95), 4),
            "first_piece_p50_s": round(statistics.median(first[name]), 4) if first[name] else None,
            "tokens_per_s": round(args.new_tokens / p50, 1),
            "p50_vs_fp32": round(p50 / base_p50, 3),
            "same_reply_as_fp32": round(
                sum(a == b for a, b in zip(replies[name], replies["fp32"])) / len(replies[name]), 3
            ),
        }
    report = {
        "model": args.model or f"random-init {args.size} (hf_ext.tiny_model, seed 0)",
        "parameters": engines["fp32"].info["parameters"],
        "settings": {"num_beams": args.num_beams, "new_tokens": args.new_tokens, "do_sample": False},
        "prompts": len(PROMPTS),
        "repeats": args.repeats,
        "threads": args.threads,
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "results": results,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")

    print(f"model: {report['model']}, {report['parameters'] / 1e6:.1f}M parameters; {report['settings']}")
    print(
        "| variant | p50 reply (s) | p95 reply (s) | first piece p50 (s) | tokens/s | p50 vs fp32 | same reply as fp32 |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, r in results.items():
        fp = "—" if r["first_piece_p50_s"] is None else f"{r['first_piece_p50_s']:.3f}"
        print(
            f"| {name} | {r['p50_s']:.3f} | {r['p95_s']:.3f} | {fp} | {r['tokens_per_s']} | "
            f"{r['p50_vs_fp32']:.2f} | {r['same_reply_as_fp32']:.0%} |"
        )
    if tmp is not None:
        tmp.cleanup()
    return report


if __name__ == "__main__":
    main()
