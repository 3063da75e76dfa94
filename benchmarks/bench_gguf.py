"""Chat-E on llama.cpp against PyTorch: the same model (``make demo``'s), the same prompts, one run, 2 threads.

Speed. Every variant answers the same 9 chats (``bench_chat``'s prompts) with greedy replies of exactly
``--new_tokens`` tokens (the end token held off, so every variant does the same work), interleaved prompt by prompt
(the order rotates), ``--repeats`` rounds:

* ``pytorch fp32`` and ``pytorch int8``: :class:`LocalEngine` (``chat-e --engine torch``, with and without
  ``--quantize int8``);
* ``chat-e llama.cpp F16 / Q8_0 / Q4_K_M``: :class:`LlamaCppEngine` on the model's GGUF export of that type (``chat-e
  --engine llamacpp --gguf_type ...``): llama.cpp's forward pass, Chat-E's prompt, processors and text;
* ``llama.cpp F16 / Q8_0 / Q4_K_M (stock)``: llama-cpp-python's own ``Llama.generate`` on the same file and the same
  prompt tokens, its own greedy sampler: what llama.cpp gives on its own, the bar for Chat-E's engine.

Each reply is streamed: first text (the first piece; stock: the first token), whole reply, and tokens per second
(``--new_tokens`` over the whole reply). p50 / p95 over prompts and rounds.

The same model (item 3 of the issue). On the model's own generation defaults (what ``chat-e`` serves): how many of the
9 greedy replies of each variant equal PyTorch fp32's; the human-reply NLL per token on ``--n_nll`` held-out rows of
make demo's validation split (``chat-e eval``'s rows, llama.cpp's logits of every reply token), paired against fp32
with a bootstrap 95 % interval; the verifiable-instruction score (``chat-e eval``'s prompts and checkers, strict) and
BLEU / chrF of ``--n_bleu`` validation replies, as a floor.

Under load (``--users 1 4 16``): a real ``chat-e`` server per engine (PyTorch int8, the default before llama.cpp, and
llama.cpp F16), that many OpenAI-API clients at once, each streaming ``--rounds`` replies of ``--new_tokens`` tokens:
p50 / p95 reply latency and the server's tokens per second.

    python -m benchmarks.bench_gguf --model runs/demo --threads 2 --doc docs/benchmarks.md --section gguf
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from benchmarks import harness
from benchmarks.bench_api import Server
from benchmarks.bench_chat import PROMPTS
from benchmarks.harness import percentile
from chat_e.data import adherence
from chat_e.data.corpora import DataArguments, load_dialogue_dataset
from chat_e.data.dialogue import parse_header, parse_texts
from chat_e.data.limits import Request
from chat_e.data.stats import paired_difference
from chat_e.engines.llamacpp import LlamaCppEngine, gguf_path, served_gguf
from chat_e.engines.local import LocalEngine
from chat_e.training.eval_cli import add_eval_arguments
from chat_e.training.evaluate import human_rows
from chat_e.training.heldout import reply_logprobs
from hf_ext.evaluation.bleu import compute_bleu_chrf
from hf_ext.saving.gguf import GGUF_SET

GGUF_NAMES = {"f16": "F16", "q8_0": "Q8_0", "q4_k_m": "Q4_K_M"}
#: the variants whose replies get the instruction score and BLEU / chrF (F16's are fp32's; int8: docs' "Chat-E serving")
SCORED = ("pytorch fp32", "chat-e llama.cpp Q8_0", "chat-e llama.cpp Q4_K_M")


def load_variants(model: Path, threads: int) -> dict:
    """name -> (engine, stock llama or None)."""
    import llama_cpp

    variants = {
        "pytorch fp32": (LocalEngine.from_pretrained(model), None),
        "pytorch int8": (LocalEngine.from_pretrained(model, quantize="int8"), None),
    }
    for kind in GGUF_SET:
        path = served_gguf(model, kind)
        variants[f"chat-e llama.cpp {GGUF_NAMES[kind]}"] = (
            LlamaCppEngine.from_pretrained(path, threads=threads),
            None,
        )
        stock = llama_cpp.Llama(str(path), n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)
        variants[f"llama.cpp {GGUF_NAMES[kind]} (stock)"] = (
            variants[f"chat-e llama.cpp {GGUF_NAMES[kind]}"][0],
            stock,
        )
    return variants


def timed_reply(engine, stock, request: Request, new_tokens: int, threads: int) -> tuple[float, float]:
    """(seconds to the first text, seconds to the whole reply) of one greedy reply of ``new_tokens`` tokens."""
    settings = engine.default_settings().replace(
        num_beams=1, do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens
    )
    torch.set_num_threads(1 if isinstance(engine, LlamaCppEngine) else threads)  # as chat-e serves each
    start = time.perf_counter()
    first = None
    if stock is None:
        stream = engine.stream(request.but(settings=settings))
        for _ in stream:
            first = first or time.perf_counter() - start
        assert stream.reply.tokens == new_tokens, stream.reply
    else:  # llama-cpp-python alone: its greedy sampler, no Chat-E code after the prompt's ids
        tokens = 0
        for _ in stock.generate(engine.encode(request), temp=0.0, top_k=1, repeat_penalty=1.0):
            first = first or time.perf_counter() - start
            tokens += 1
            if tokens == new_tokens:
                break
    return first, time.perf_counter() - start


def speed(variants: dict, args) -> dict:
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    names = list(variants)
    for name in names:  # a first reply each: the weights paged in, the caches made
        timed_reply(*variants[name], PROMPTS[-1], args.new_tokens, args.threads)
    for round_ in range(args.repeats):
        for i, request in enumerate(PROMPTS):
            shift = (i + round_) % len(names)
            for name in names[shift:] + names[:shift]:
                times[name].append(timed_reply(*variants[name], request, args.new_tokens, args.threads))
    out = {}
    for name, pairs in times.items():
        firsts, wholes = [p[0] for p in pairs], [p[1] for p in pairs]
        out[name] = {
            "reply_p50": statistics.median(wholes),
            "reply_p95": percentile(wholes, 0.95),
            "first_p50": statistics.median(firsts),
            "tokens_per_s": args.new_tokens / statistics.median(wholes),
            "replies": len(pairs),
        }
    return out


def llama_nll(engine: LlamaCppEngine, rows, path: Path, threads: int) -> list[float]:
    """Each row's human-reply NLL per token under llama.cpp (its logits at every reply position)."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=2048, n_threads=threads, logits_all=True, verbose=False,
                          type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)  # fmt: skip
    out = []
    for prompt, reply in rows:
        llm.reset()
        llm.eval(prompt + reply)
        logits = np.asarray(llm.scores[len(prompt) - 1 : len(prompt) + len(reply) - 1], dtype=np.float64)
        logp = logits - logits.max(axis=1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(axis=1, keepdims=True))
        out.append(-float(np.mean(logp[np.arange(len(reply)), reply])))
    llm.close()
    return out


def fidelity(variants: dict, model: Path, args) -> dict:
    """Same replies as fp32 on the model's defaults, NLL, instructions and BLEU/chrF per engine variant."""
    eval_parser = argparse.ArgumentParser()
    add_eval_arguments(eval_parser)
    eval_args = eval_parser.parse_args(["--model", str(model), "--n_nll", str(args.n_nll)])
    base = variants["pytorch fp32"][0]
    rows = human_rows(base, eval_args)
    pad = base.tokenizer.pad_token_id
    with torch.no_grad():
        table = reply_logprobs(base.model, rows, 16, pad)
    nll = {"pytorch fp32": (-table[:, 0] / table[:, 1].clamp(min=1)).tolist()}
    data = load_dialogue_dataset(DataArguments(dataset_name="chitchat+chatterbot", n_val=args.n_bleu))["validation"]
    chats = []
    for texts in data["texts"]:
        header, turns = parse_texts(texts)
        chats.append(Request(turns[-1], turns[:-1], *parse_header(header)))
    probes = [Request(p.message) for p in adherence.PROMPTS]
    engines = {name: engine for name, (engine, stock) in variants.items() if stock is None}
    out = {}
    for name, engine in engines.items():
        defaults = engine.default_settings()
        greedy = defaults.replace(num_beams=1, do_sample=False, max_new_tokens=48)
        replies = [engine.reply(r.but(settings=defaults)).text for r in PROMPTS]
        out[name] = {"prompt_replies": replies}
        if name.startswith("chat-e"):
            kind = next(k for k, v in GGUF_NAMES.items() if name.endswith(v))
            nll[name] = llama_nll(engine, rows, gguf_path(model, kind), args.threads)
        elif name != "pytorch fp32":
            with torch.no_grad():
                table = reply_logprobs(engine.model, rows, 16, pad)
            nll[name] = (-table[:, 0] / table[:, 1].clamp(min=1)).tolist()
        out[name]["nll"] = float(np.mean(nll[name]))
        if name in SCORED:  # the replies' scores: the reference and the two types whose replies differ from it
            instructions = adherence.score_instructions([engine.reply(p.but(settings=greedy)).text for p in probes])
            bleu = compute_bleu_chrf(
                [engine.reply(c.but(settings=defaults)).text for c in chats], list(data["labels"])
            )
            out[name].update(
                instruction_strict=float(np.mean([p["strict"] for p in instructions["prompts"]])),
                bleu=bleu["bleu"],
                chrf=bleu["chrf"],
            )
    for name in engines:
        out[name]["same_as_fp32"] = sum(
            a == b for a, b in zip(out[name]["prompt_replies"], out["pytorch fp32"]["prompt_replies"])
        )
        out[name]["nll_diff"] = paired_difference(nll["pytorch fp32"], nll[name]).as_dict()
    return out


def under_load(model: Path, args) -> dict:
    """p50 / p95 reply seconds and the server's tokens/s with N clients at once, per served engine."""
    import openai

    out = {}
    # each as chat-e serves it by default: PyTorch's replies at once share the cores, llama.cpp's take turns on all
    served = (("pytorch int8", "torch", max(1, args.threads // 2)), ("llama.cpp F16", "llamacpp", args.threads))
    for label, engine, threads in served:
        extra = ["--engine", engine]
        with tempfile.TemporaryDirectory() as tmp:
            server = Server(model, Path(tmp) / "chat-e.log", threads=threads, new_tokens=args.new_tokens,
                            extra=[*extra, "--concurrency", "2", "--max_queue", "64"])  # fmt: skip
            try:
                server.wait_ready()
                client = openai.OpenAI(base_url=f"{server.url}v1", api_key="unused", timeout=600)

                def user(i: int, client=client) -> list[float]:
                    seconds = []
                    for r in range(args.rounds):
                        start = time.perf_counter()
                        stream = client.chat.completions.create(
                            model="any", stream=True, max_tokens=args.new_tokens,
                            messages=[{"role": "user", "content": PROMPTS[(i + r) % len(PROMPTS)].message}],
                        )  # fmt: skip
                        for _ in stream:
                            pass
                        seconds.append(time.perf_counter() - start)
                    return seconds

                for users in args.users:
                    start = time.perf_counter()
                    with concurrent.futures.ThreadPoolExecutor(users) as pool:
                        lists = list(pool.map(user, range(users)))
                    wall = time.perf_counter() - start
                    seconds = [s for one in lists for s in one]
                    out.setdefault(label, {})[users] = {
                        "reply_p50": statistics.median(seconds),
                        "reply_p95": percentile(seconds, 0.95),
                        "tokens_per_s": len(seconds) * args.new_tokens / wall,
                    }
            finally:
                server.stop()
    return out


def tables(report: dict) -> list[str]:
    speed_rows = report["speed"]
    stock = {v: speed_rows[f"llama.cpp {v} (stock)"]["tokens_per_s"] for v in GGUF_NAMES.values()}
    rows = []
    for name, r in speed_rows.items():
        bar = next((stock[v] for v in stock if name == f"chat-e llama.cpp {v}"), None)
        rows.append([name, f"{r['reply_p50']:.2f}", f"{r['reply_p95']:.2f}", f"{r['first_p50'] * 1000:.0f}",
                     f"{r['tokens_per_s']:.1f}", f"{r['tokens_per_s'] / bar:.2f}" if bar else ""])  # fmt: skip
    parts = [
        f"{report['new_tokens']}-token greedy replies to {len(PROMPTS)} chats, {report['repeats']} rounds interleaved, "
        f"{report['threads']} threads (llama.cpp's; torch's 1 beside them, as chat-e serves it), `{report['model']}`:",
        harness.markdown_table(
            ["variant", "reply p50 (s)", "reply p95 (s)", "first text p50 (ms)", "tokens/s", "of stock llama.cpp"],
            rows,
        ),
    ]
    fid = report["fidelity"]
    rows = []
    for name, r in fid.items():
        d = r["nll_diff"]
        nll = "" if name == "pytorch fp32" else f"{d['diff']:+.4f} [{d['low']:+.4f}, {d['high']:+.4f}]"
        scores = (
            [f"{100 * r['instruction_strict']:.1f}%", f"{r['bleu']:.2f}", f"{r['chrf']:.2f}"]
            if name in SCORED
            else [""] * 3
        )
        rows.append([name, f"{r['same_as_fp32']}/{len(PROMPTS)}", f"{r['nll']:.4f}", nll, *scores])
    parts += [
        f"The same model? The model's own generation defaults, {report['n_nll']} held-out human replies (NLL), "
        f"{report['n_bleu']} validation contexts (BLEU, chrF):",
        harness.markdown_table(
            [
                "variant",
                "greedy replies = fp32's",
                "human-reply NLL/token",
                "NLL − fp32, 95 % CI",
                "instructions, strict",
                "BLEU",
                "chrF",
            ],
            rows,
        ),  # fmt: skip
    ]
    if report.get("load"):
        rows = [[label, users, f"{r['reply_p50']:.2f}", f"{r['reply_p95']:.2f}", f"{r['tokens_per_s']:.1f}"]
                for label, by_users in report["load"].items() for users, r in by_users.items()]  # fmt: skip
        parts += [
            f"Through the real server (`chat-e --concurrency 2`: PyTorch's two replies at once on {max(1, report['threads'] // 2)} "
            f"thread each, llama.cpp's in turn on {report['threads']}; the OpenAI API, streamed, {report['new_tokens']} "
            f"tokens a reply, {report['rounds']} replies per user):",
            harness.markdown_table(["served by", "users at once", "reply p50 (s)", "reply p95 (s)", "tokens/s"], rows),
        ]
    return parts


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_served_model_argument(parser)
    parser.add_argument("--threads", type=int, default=2, help="Threads of every variant (default 2).")
    parser.add_argument("--new_tokens", type=int, default=64, help="Reply length of the speed runs (default 64).")
    parser.add_argument("--repeats", type=int, default=2, help="Rounds over the 10 chats (default 2).")
    parser.add_argument("--n_nll", type=int, default=128, help="Held-out human replies scored (default 128).")
    parser.add_argument("--n_bleu", type=int, default=50, help="Validation contexts for BLEU (default 50).")
    parser.add_argument("--users", type=int, nargs="*", default=[1, 4, 16], help="Clients at once (default 1 4 16).")
    parser.add_argument("--rounds", type=int, default=2, help="Replies per client under load (default 2).")
    harness.add_publish_arguments(parser, "runs/bench/gguf.json", "gguf")
    args = parser.parse_args(argv)
    model = harness.served_model(parser, args)
    torch.set_num_threads(args.threads)
    variants = load_variants(model, args.threads)
    report = {"model": str(model), "threads": args.threads, "new_tokens": args.new_tokens, "repeats": args.repeats,
              "n_nll": args.n_nll, "n_bleu": args.n_bleu, "rounds": args.rounds}  # fmt: skip
    report["speed"] = speed(variants, args)
    report["fidelity"] = fidelity(variants, model, args)
    del variants
    report["load"] = under_load(model, args) if args.users else {}
    return harness.publish("benchmarks.bench_gguf", argv, tables(report), report, args)


if __name__ == "__main__":
    main()
