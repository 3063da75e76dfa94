"""Chat-E serving on CPU: stock ``model.generate`` vs LocalEngine in fp32 / bf16 / int8, and the BLEU of the three.

Latency. Every variant answers the same prompts in the same run, interleaved prompt by prompt (the order of the
variants rotates from one prompt to the next) so that background load hits them alike:

* ``stock``: what a user without hf-ext writes -- ``AutoTokenizer`` + the model's class ``.from_pretrained(dir)``
  in fp32, the context string tokenized (a chat model's: its chat template rendered), ``model.generate(**inputs)``
  under ``torch.no_grad()``, the new tokens decoded. The string is the one LocalEngine builds, and its token ids are
  checked to equal the engine's, so both see the same input;
* ``engine``: ``LocalEngine`` as ``chat-e`` serves by default (fp32);
* ``engine-bf16`` (``chat-e --dtype bf16``) and ``engine-int8`` (``chat-e --quantize int8``: dynamic quantization of
  every ``nn.Linear``).

``--num_beams 0`` generates with the model's own ``generation_config`` (BlenderBot: 10 beams, 19-59 new tokens, no
repeated 3-grams) for stock and engine alike. ``--num_beams N`` (N >= 1) forces N beams, no sampling and replies of
exactly ``--new_tokens`` tokens, so that every variant does the same work. Time to first token is how long
``LocalEngine.stream`` takes to yield its first text; beam search cannot stream, and stock ``generate`` does not, so for
stock, and for every variant when beams > 1, it is the whole reply. Reports p50 / p95 reply latency, time to first
token, reply length (the reply re-tokenized), the ratio to stock's p50, and how often a reply equals stock's.

BLEU (``--bleu_model DIR``, a fine-tuned model such as the one ``make demo`` writes to ``runs/demo``): LocalEngine in
fp32, bf16 and int8 answers ``--bleu_examples`` contexts of an offline validation split (``--bleu_dataset``, the one
the model was tuned on) with the model's generation defaults (what ``chat-e`` serves); corpus sacreBLEU and chrF
against the labels, and each variant's BLEU difference to fp32.

    python -m benchmarks.bench_chat --model runs/demo --num_beams 0 --repeats 2 --threads 2 \
        --bleu_model runs/demo --bleu_dataset chitchat+chatterbot --out runs/bench/chat_e_smollm2.json
    python -m benchmarks.bench_chat --size 400m --repeats 1 --num_beams 0 --threads 2 --out runs/bench/chat_e_400m.json
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from benchmarks import harness
from benchmarks.harness import load_average, percentile
from chat_e.data.corpora import DataArguments, load_dialogue_dataset
from chat_e.data.dialogue import encode_texts, parse_header, parse_texts
from chat_e.data.limits import Request
from chat_e.engines.local import LocalEngine
from hf_ext.evaluation.bleu import compute_bleu_chrf
from hf_ext.model_info import model_class

#: precision -> LocalEngine.from_pretrained keywords
PRECISIONS = {"fp32": {}, "bf16": {"dtype": "bf16"}, "int8": {"quantize": "int8"}}
#: latency variant -> precision (``stock`` is loaded without hf-ext)
ENGINE_VARIANTS = {"engine": "fp32", "engine-bf16": "bf16", "engine-int8": "int8"}
PROMPTS = [
    Request(
        "Hi! What's your name?", [], "persona", "My name is Chat-E. I'm helpful, creative, clever and very friendly."
    ),
    Request("I finally got the job!", [], "emotion", "happy"),
    Request("Where should I go in July?", ["I want a break.", "Where to?"], "domain", "vacation ideas"),
    Request("Do you like movies?", ["hello", "hi, how are you?", "good, thanks"], "none", None),
    Request("What's the best pizza topping?", [], "topic", "favorite foods"),
    Request("My dog is sick and I'm worried.", [], "emotion", "sad"),
    Request("Can you recommend a book?", ["I read a lot.", "What do you read?"], "persona", "I love science fiction."),
    Request("What is the capital of France?", [], "none", None),
    Request("Any tips for cheap flights?", ["We fly next week."], "domain", "travel"),
]


# ---------------------------------------------------------------------------------------------- the variants
def stock_runner(
    model_dir: str, engine: LocalEngine, gen_kwargs: dict, dtype: torch.dtype = torch.float32, device: str = "cpu"
):
    """A reply function for plain transformers: the engine only builds the context string, as a user would by hand.
    The model is loaded in ``dtype`` and moved to ``device``; ``run(prompt, text, **overrides)`` passes
    ``overrides`` on to ``generate`` (over ``gen_kwargs``)."""
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = model_class(AutoConfig.from_pretrained(model_dir)).from_pretrained(model_dir, dtype=dtype)
    model = model.to(device).eval()
    decoder_only = engine.family == "causal"  # its output starts with the prompt

    def text_of(prompt) -> str:
        text = engine.model_input_text(prompt)  # the truncated context, ending in the </s> the tokenizer adds
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if ids != engine.encode(prompt):
            raise RuntimeError(f"stock and engine inputs differ for {prompt!r}; the comparison would be unfair.")
        return text

    def run(prompt, text: str, **overrides) -> tuple[str, float, float]:
        start = time.perf_counter()
        inputs = tokenizer(text, add_special_tokens=False, return_tensors="pt").to(device)
        with torch.no_grad():
            out = model.generate(**inputs, **{**gen_kwargs, **overrides})
        start_at = inputs["input_ids"].shape[1] if decoder_only else 0
        reply = tokenizer.decode(out[0, start_at:], skip_special_tokens=True).strip()
        latency = time.perf_counter() - start
        return reply, latency, latency  # no streaming: the first token arrives with the whole reply

    return text_of, run


def engine_runner(engine: LocalEngine, settings, stream: bool):
    def run(prompt, text: str) -> tuple[str, float, float]:
        start = time.perf_counter()
        reply = engine.reply(prompt.but(settings=settings)).text
        latency = time.perf_counter() - start
        first = latency
        if stream:
            start = time.perf_counter()
            pieces = engine.stream(prompt.but(settings=settings))
            next(pieces, "")
            first = time.perf_counter() - start
            pieces.close()
        return reply, latency, first

    return run


def latency_benchmark(model_dir: str, args) -> dict:
    engines = {name: LocalEngine.from_pretrained(model_dir, **PRECISIONS[p]) for name, p in ENGINE_VARIANTS.items()}
    base = engines["engine"]
    if args.num_beams == 0:  # the model's own defaults, for stock (no kwargs) and engine alike
        settings, gen_kwargs = base.default_settings(), {}
    else:
        n = args.new_tokens
        settings = base.default_settings().replace(
            num_beams=args.num_beams, do_sample=False, max_new_tokens=n, min_new_tokens=n
        )
        # an encoder-decoder's max_length / min_length count the decoder start token; they override BlenderBot's
        # own (max_new_tokens would too, with a warning per call that both are set). A decoder-only model's count
        # the prompt too: it gets the new-token limits.
        if base.family == "seq2seq":
            gen_kwargs = dict(num_beams=args.num_beams, do_sample=False, max_length=n + 1, min_length=n + 1)
        else:
            gen_kwargs = dict(num_beams=args.num_beams, do_sample=False, max_new_tokens=n, min_new_tokens=n)
    stream = settings.num_beams == 1
    text_of, stock = stock_runner(model_dir, base, gen_kwargs)
    runners = {"stock": stock, **{name: engine_runner(e, settings, stream) for name, e in engines.items()}}
    texts = [text_of(prompt) for prompt in PROMPTS]
    for run in runners.values():  # warm-up
        run(PROMPTS[0], texts[0])

    names = list(runners)
    rows = {name: {"latency": [], "first": [], "replies": []} for name in names}
    step = 0
    for _ in range(args.repeats):
        for prompt, text in zip(PROMPTS, texts):
            for name in names[step % len(names) :] + names[: step % len(names)]:
                reply, latency, first = runners[name](prompt, text)
                rows[name]["latency"].append(latency)
                rows[name]["first"].append(first)
                rows[name]["replies"].append(reply)
            step += 1
            print(
                f"prompt {step}/{args.repeats * len(PROMPTS)} answered by every variant", file=sys.stderr, flush=True
            )

    tokenizer = base.tokenizer
    stock_p50 = statistics.median(rows["stock"]["latency"])
    results = {}
    for name, row in rows.items():
        p50 = statistics.median(row["latency"])
        tokens = [len(tokenizer(r, add_special_tokens=False)["input_ids"]) for r in row["replies"]]
        results[name] = {
            "p50_s": round(p50, 4),
            "p95_s": round(percentile(row["latency"], 0.95), 4),
            "first_token_p50_s": round(statistics.median(row["first"]), 4),
            "first_token_streamed": stream and name != "stock",
            "reply_tokens_mean": round(statistics.mean(tokens), 1),
            "tokens_per_s": round(sum(tokens) / sum(row["latency"]), 2),
            "p50_vs_stock": round(p50 / stock_p50, 3),
            "latencies_s": [round(x, 3) for x in row["latency"]],
            "same_reply_as_stock": round(
                sum(a == b for a, b in zip(row["replies"], rows["stock"]["replies"])) / len(row["replies"]), 3
            ),
        }
    return {
        "parameters": base.info["parameters"],
        "settings": {
            "mode": "model generation_config" if args.num_beams == 0 else "forced",
            "num_beams": settings.num_beams,
            "do_sample": settings.do_sample,
            "max_new_tokens": settings.max_new_tokens,
            "min_new_tokens": settings.min_new_tokens,
            "no_repeat_ngram_size": base.generation_config.no_repeat_ngram_size,
            "stock_generate_kwargs": gen_kwargs,
        },
        "example_replies": {name: row["replies"][:2] for name, row in rows.items()},
        "results": results,
    }


# ---------------------------------------------------------------------------------------------- BLEU
def bleu_benchmark(model_dir: str, n_examples: int, dataset: str = "chatterbot") -> dict:
    """Corpus BLEU of LocalEngine in fp32, bf16 and int8 on an offline validation split, model defaults."""
    data = load_dialogue_dataset(DataArguments(dataset_name=dataset, n_val=n_examples))["validation"]
    chats = []
    for texts in data["texts"]:
        header, turns = parse_texts(texts)
        mode, context = parse_header(header)
        chats.append(Request(turns[-1], turns[:-1], mode, context))
    refs = list(data["labels"])
    results, replies = {}, {}
    for name, kwargs in PRECISIONS.items():
        engine = LocalEngine.from_pretrained(model_dir, **kwargs)
        settings = engine.default_settings()
        same_input = sum(
            engine.encode(chat) == encode_texts(engine.tokenizer, texts, engine.max_input_length, engine.family)
            for chat, texts in zip(chats, data["texts"])
        )
        start = time.perf_counter()
        replies[name] = [engine.reply(chat.but(settings=settings)).text for chat in chats]
        seconds = time.perf_counter() - start
        scores = compute_bleu_chrf(replies[name], refs)
        results[name] = {
            "bleu": round(scores["bleu"], 3),
            "chrf": round(scores["chrf"], 3),
            "seconds": round(seconds, 1),
            "inputs_as_in_training": f"{same_input}/{len(chats)}",
        }
    for name, r in results.items():
        r["bleu_minus_fp32"] = round(r["bleu"] - results["fp32"]["bleu"], 3)
        r["same_reply_as_fp32"] = round(sum(a == b for a, b in zip(replies[name], replies["fp32"])) / len(refs), 3)
        r["within_0.5_of_fp32"] = abs(r["bleu_minus_fp32"]) <= 0.5
    return {
        "model": model_dir,
        "data": f"{dataset} validation split (chat_e.data.corpora, seed 42)",
        "examples": len(refs),
        "settings": {
            "generation": "the model's generation_config (LocalEngine.default_settings())",
            **asdict(settings),
        },
        "results": results,
    }


# ---------------------------------------------------------------------------------------------- report
def latency_table(latency: dict) -> str:
    lines = [
        "| variant | p50 reply (s) | p95 reply (s) | first token p50 (s) | reply tokens | tokens/s | p50 vs stock "
        "| same reply as stock |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in latency["results"].items():
        first = f"{r['first_token_p50_s']:.3f}" + ("" if r["first_token_streamed"] else " (whole reply)")
        lines.append(
            f"| {name} | {r['p50_s']:.3f} | {r['p95_s']:.3f} | {first} | {r['reply_tokens_mean']} | "
            f"{r['tokens_per_s']} | {r['p50_vs_stock']:.2f} | {r['same_reply_as_stock']:.0%} |"
        )
    return "\n".join(lines)


def bleu_table(bleu: dict) -> str:
    lines = ["| variant | BLEU | chrF | BLEU − fp32 | within 0.5 | same reply as fp32 |", "|---|---|---|---|---|---|"]
    for name, r in bleu["results"].items():
        lines.append(
            f"| {name} | {r['bleu']:.2f} | {r['chrf']:.2f} | {r['bleu_minus_fp32']:+.2f} | "
            f"{'yes' if r['within_0.5_of_fp32'] else 'no'} | {r['same_reply_as_fp32']:.0%} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="A model directory; default: build a random-init one of --size.")
    parser.add_argument("--size", default="small", choices=("tiny", "small", "400m"))
    parser.add_argument("--out", required=True, help="Where to write the JSON results.")
    parser.add_argument("--repeats", type=int, default=3, help="Passes over the prompts (default 3).")
    parser.add_argument(
        "--num_beams",
        type=int,
        default=1,
        help="Beams (default 1: greedy, streams); 0: the model's generation_config.",
    )
    parser.add_argument("--new_tokens", type=int, default=32, help="With --num_beams >= 1, every reply is this long.")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: one reply per core).")
    parser.add_argument("--bleu_model", help="A fine-tuned model dir (e.g. runs/demo) for the BLEU check; else none.")
    parser.add_argument("--bleu_examples", type=int, default=200, help="Validation contexts for BLEU (default 200).")
    parser.add_argument(
        "--bleu_dataset", default="chatterbot", help="Offline corpus of the BLEU contexts (chat_e.data.corpora names)."
    )
    args = parser.parse_args(argv)
    if args.num_beams < 0:
        parser.error(f"--num_beams {args.num_beams}: use 0 (the model's generation_config) or a number of beams.")
    if args.bleu_model and not (Path(args.bleu_model) / "config.json").is_file():
        parser.error(
            f"--bleu_model {args.bleu_model}: no model directory there (no config.json). Run `make demo` to train "
            "the tiny model into runs/demo, or pass another fine-tuned model directory."
        )
    torch.set_num_threads(args.threads)
    load = {"start": load_average()}

    tmp = None
    model_dir = args.model
    if model_dir is None:
        tmp = tempfile.TemporaryDirectory()
        model_dir = str(harness.ensure_model(args.size, Path(tmp.name) / args.size))

    started = time.perf_counter()
    load["latency_start"] = load_average()
    latency = latency_benchmark(model_dir, args)
    load["latency_end"] = load_average()
    latency_seconds = time.perf_counter() - started
    if tmp is not None:
        tmp.cleanup()
    bleu = bleu_benchmark(args.bleu_model, args.bleu_examples, args.bleu_dataset) if args.bleu_model else None
    load["end"] = load_average()

    report = {
        "command": harness.command("benchmarks.bench_chat", argv),
        "model": args.model or f"random-init {args.size} (chat_e.data.models, seed 0)",
        "parameters": latency.pop("parameters"),
        "prompts": len(PROMPTS),
        "repeats": args.repeats,
        "threads": args.threads,
        "host": harness.host_info(),
        "load_average_1_5_15min": load,
        "latency_seconds": round(latency_seconds, 1),
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "latency": latency,
        "bleu": bleu,
    }
    harness.write_json(args.out, report)

    print(f"model: {report['model']}, {report['parameters'] / 1e6:.1f}M parameters; {latency['settings']}")
    print(f"load average (1/5/15 min): {load}")
    print(latency_table(latency))
    if bleu is not None:
        print(f"\nBLEU: {bleu['model']}, {bleu['examples']} validation contexts, {bleu['settings']['generation']}")
        print(bleu_table(bleu))
    return report


if __name__ == "__main__":
    main()
