"""GGUF out of a Chat-E model (``hf-ext export --format gguf``) and the llama.cpp engine on it, on the tiny chat model:

* the F16 file read back by transformers' own GGUF reader is the model (weights to F16's rounding), its tokenizer
  and chat template; the generation defaults ride along; Q8_0 and Q4_K_M are llama.cpp's own types;
* a model llama.cpp's Llama graph cannot run is refused in one line; an export killed at any write leaves the old
  file or the new one, never part of one, and the next export clears what it left;
* the llama.cpp engine's greedy replies are PyTorch's, token for token, over every mode, a history and a context
  (the PyTorch engine is the oracle), and the engine protocol holds: pieces, finish reason, token counts, a closed
  stream's partial reply, seeded sampling, the reply's shortest length, a chat's next turn after the cache.
"""

from __future__ import annotations

import copy
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from chat_e.data.settings import LENGTH, RequestSampling
from chat_e.engines.llamacpp import LlamaCppEngine
from chat_e.engines.local import LocalEngine
from hf_ext.saving.gguf import GENERATION_CONFIG_KEY, gguf_fields, read_gguf

from ..app.support import make_sensitive_model, request
from ..conftest import ROOT, launch_env, python_cmd, run_side_by_side

pytestmark = pytest.mark.slow

HF_EXT = str(Path(sys.executable).parent / "hf-ext")  # the installed command
WORKER = ROOT / "tests" / "integration" / "workers" / "export_kill.py"
#: every mode, a history, a persona and a topic: what the engine encodes must be what PyTorch's encodes
REQUESTS = [
    ("Hi! Who are you?", [], "none", None),
    ("What do you do for fun?", ["Hello!", "Hi there, nice to meet you."], "none", None),
    ("Tell me about your weekend.", [], "persona", "I love hiking. I have two dogs."),
    ("Any plans for the summer?", [], "domain", "vacation ideas"),
    ("I just got a new job!", ["How are you?", "Fine, and you?"], "emotion", "joyful"),
    ("Can you recommend a book?", [], "topic", "science fiction"),
    ("How old are you?", ["Do you like dogs?", "I do, a lot."], "free", None),
    ("It's raining again today.", [], "none", None),
]


def export(src: Path, out: Path, kind: str = "f16", *extra: str) -> subprocess.CompletedProcess:
    cmd = [HF_EXT, "export", str(src), "--out", str(out), "--format", "gguf",
           "--gguf_type", kind, *extra]  # fmt: skip
    return subprocess.run(cmd, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def chat_model(tiny_chat_model_dir, tmp_path_factory) -> Path:
    """The tiny chat model with large weights: its replies depend on the whole prompt, and its logits rarely tie."""
    return make_sensitive_model(tiny_chat_model_dir, tmp_path_factory.mktemp("gguf") / "model", std=0.5)


@pytest.fixture(scope="module")
def files(chat_model, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf_files")
    out = {kind: root / f"model-{kind}.gguf" for kind in ("f32", "f16", "q8_0", "q4_k_m")}
    procs = run_side_by_side([
        [HF_EXT, "export", str(chat_model), "--out", str(path), "--format", "gguf",
         "--gguf_type", kind] for kind, path in out.items()
    ], timeout=600)  # fmt: skip
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def test_the_f16_file_is_the_model_in_transformers_own_reader(chat_model, files):
    model, tokenizer = read_gguf(files["f16"])
    source = AutoModelForCausalLM.from_pretrained(chat_model, dtype=torch.float32)
    want = {k: v.to(torch.float16).to(torch.float32) for k, v in source.state_dict().items()}
    got = model.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name  # F16 of the same number is one number
    source_tokenizer = AutoTokenizer.from_pretrained(chat_model)
    text = "Hello there, how are you? 3.14 naïve <|im_start|>"
    assert tokenizer(text).input_ids == source_tokenizer(text).input_ids
    assert tokenizer.chat_template == source_tokenizer.chat_template
    stored = gguf_fields(files["f16"])
    assert stored["generation_config"] == json.loads(GenerationConfig.from_pretrained(chat_model).to_json_string(True))
    assert GENERATION_CONFIG_KEY in stored and stored["tokenizer.ggml.pre"] == "gpt-2"


def test_q8_0_and_q4_k_m_are_llama_cpp_s_types_and_smaller(files):
    import gguf

    types = {kind: {t.name: t.tensor_type for t in gguf.GGUFReader(str(path)).tensors} for kind, path in files.items()}
    assert types["f16"]["blk.0.ffn_up.weight"] == gguf.GGMLQuantizationType.F16
    assert types["q8_0"]["blk.0.ffn_up.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert gguf_fields(files["q4_k_m"])["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q4_K_M
    assert types["q8_0"]["blk.0.attn_norm.weight"] == gguf.GGMLQuantizationType.F32  # norms stay F32
    sizes = [files[kind].stat().st_size for kind in ("f32", "f16", "q8_0", "q4_k_m")]
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == 4


def test_a_model_llama_cpp_s_llama_graph_cannot_run_is_refused_in_one_line(tiny_model_dir, tmp_path):
    proc = export(tiny_model_dir, tmp_path / "blenderbot.gguf")
    assert proc.returncode == 1
    lines = [line for line in proc.stderr.splitlines() if line.startswith("hf-ext export:")]
    assert len(lines) == 1 and "BlenderbotForConditionalGeneration" in lines[0] and "convert_hf_to_gguf" in lines[0]
    assert not list(tmp_path.iterdir())


def test_an_export_killed_at_any_write_leaves_the_old_file_or_the_new(chat_model, files, tmp_path):
    """The old content is the F32 file, the new one the F16 export; each export kills itself at one write event."""
    listed = tmp_path / "listed.gguf"
    shutil.copy(files["f32"], listed)
    worker = [*python_cmd(WORKER), str(chat_model)]
    proc = subprocess.run([*worker, str(listed), "--gguf_type", "f16", "--list", str(tmp_path / "ev")],
                          cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    events = json.loads((tmp_path / "ev").read_text())
    assert events == ["header written", "metadata written", "tensors written", "rename"]
    old, new = files["f32"].read_bytes(), files["f16"].read_bytes()
    outs = {k: tmp_path / f"kill{k}.gguf" for k in range(1, len(events) + 1)}
    for path in outs.values():
        shutil.copy(files["f32"], path)
    killed = run_side_by_side(
        [[*worker, str(path), "--gguf_type", "f16", "--kill_at", str(k)] for k, path in outs.items()],
        timeout=600,
    )
    for (k, path), proc in zip(outs.items(), killed):
        assert proc.returncode == -signal.SIGKILL, (k, proc.stderr[-2000:])
        assert path.read_bytes() == old, f"killed after {events[k - 1]}: not the old file"
    assert any(p.name.endswith(".tmp") for p in tmp_path.iterdir())  # what the killed writers left
    # the next export of one of them clears every leftover of that file and writes the new content
    proc = export(chat_model, outs[3])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert outs[3].read_bytes() == new
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".kill3.gguf.")]


# ---- the llama.cpp engine ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(chat_model, files):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield (
            LocalEngine.from_pretrained(chat_model),
            LlamaCppEngine.from_pretrained(files["f32"], threads=1),
            LlamaCppEngine.from_pretrained(files["f16"], threads=1),
        )
    finally:
        torch.set_num_threads(threads)


def greedy(engine, message, history=(), mode="none", context=None, **overrides):
    settings = {"num_beams": 1, "do_sample": False, "max_new_tokens": 24, "min_new_tokens": 0, **overrides}
    return request(engine, message, history, mode, context, **settings)


def test_greedy_replies_are_pytorch_s_token_for_token(engines):
    """F32 against the fp32 model on every request, in turn on one engine (each reuses the cache of the one before
    where their prompts share a prefix): the same text, token count and finish reason. Measured on this model: the
    llama.cpp F32 logits differ from PyTorch's by at most 8e-5 (its fp32 attention cache; 0.06 with llama.cpp's
    default F16 cache), while the smallest gap between the two likeliest tokens of these replies is 0.011: a kernel
    order cannot swap them on any CPU. F16 weights move the logits by more (their rounding): the issue's bar, the same
    reply on all but one request in eight, and 7 or 8 of 8 measured."""
    torch_engine, f32, f16 = engines
    same_f16 = 0
    for message, history, mode, context in REQUESTS:
        want = torch_engine.reply(greedy(torch_engine, message, history, mode, context))
        assert want.tokens > 3  # a reply, not an immediate end
        got = f32.reply(greedy(f32, message, history, mode, context))
        assert (got.text, got.tokens, got.prompt_tokens, got.finish_reason) == (
            want.text, want.tokens, want.prompt_tokens, want.finish_reason
        ), message  # fmt: skip
        same_f16 += f16.reply(greedy(f16, message, history, mode, context)).text == want.text
    assert same_f16 >= len(REQUESTS) - 1


def test_the_engine_protocol_pieces_lengths_and_counts(engines):
    torch_engine, f32, _ = engines
    stream = f32.stream(greedy(f32, "What do you do for fun?"))
    pieces = list(stream)
    assert len(pieces) > 1 and "".join(pieces) == stream.reply.text
    assert stream.reply == f32.reply(greedy(f32, "What do you do for fun?"))
    assert stream.reply.model == f32.name
    short = f32.reply(greedy(f32, "Tell me a long story.", max_new_tokens=5, min_new_tokens=5))
    assert (short.finish_reason, short.tokens) == (LENGTH, 5)
    # closed after two pieces: the reply so far, with its token count
    stream = f32.stream(greedy(f32, "What do you do for fun?"))
    first = next(stream) + next(stream)
    stream.close()
    whole = f32.reply(greedy(f32, "What do you do for fun?"))
    assert stream.reply.text == first and 2 <= stream.reply.tokens < whole.tokens


def test_the_end_token_and_the_shortest_length_as_pytorch_s(engines, files):
    """The tiny model never says its end token: both engines get the 4th token of a greedy reply as theirs. Without
    a minimum both stop there; with a minimum of 10 tokens both run past it, to the same reply."""
    torch_engine, _, _ = engines
    inputs, config, processors = torch_engine._prepare(greedy(torch_engine, "Hi! Who are you?"))
    ids = torch_engine.model.generate(**inputs, generation_config=config)[0, inputs["input_ids"].shape[1] :].tolist()
    ending = copy.deepcopy(torch_engine.generation_config)
    ending.eos_token_id = ids[3]
    pytorch = LocalEngine(torch_engine.model, torch_engine.tokenizer, ending)
    llama = LlamaCppEngine.from_pretrained(files["f32"], threads=1)
    llama.generation_config = ending
    for shortest in (0, 10):
        want = pytorch.reply(greedy(pytorch, "Hi! Who are you?", min_new_tokens=shortest))
        got = llama.reply(greedy(llama, "Hi! Who are you?", min_new_tokens=shortest))
        assert (got.text, got.tokens, got.finish_reason) == (want.text, want.tokens, want.finish_reason)
        assert got.tokens == ids.index(ids[3]) if shortest == 0 else got.tokens >= 10
    assert got.finish_reason in ("stop", "length")


def test_a_seeded_sampled_reply_repeats_and_another_seed_differs(engines):
    _, f32, _ = engines

    def sampled(seed):
        settings = f32.default_settings().replace(num_beams=1, do_sample=True, temperature=1.5, max_new_tokens=16,
                                                  min_new_tokens=16)  # fmt: skip
        return f32.reply(request(f32, "Tell me something.", settings=settings, sampling=RequestSampling(seed=seed)))

    assert sampled(7).text == sampled(7).text
    assert len({sampled(seed).text for seed in range(4)}) > 1


def test_a_chat_s_next_turn_after_the_cache_is_the_fresh_reply(engines, files):
    """The second turn shares the first's prompt as its prefix: the engine re-reads only the new tokens. Its reply
    is the one a fresh engine (no cache) gives, and PyTorch's."""
    torch_engine, f32, _ = engines
    first = greedy(f32, "Hello!", [], "persona", "I love hiking.")
    reply = f32.reply(first).text
    second = ("Where do you hike?", ["Hello!", reply], "persona", "I love hiking.")
    cached = f32.reply(greedy(f32, *second))
    fresh = LlamaCppEngine.from_pretrained(files["f32"], threads=1).reply(greedy(f32, *second))
    assert (cached.text, cached.tokens) == (fresh.text, fresh.tokens)
    assert cached.text == torch_engine.reply(greedy(torch_engine, *second)).text


def test_chat_e_picks_llama_cpp_for_a_llama_model_unless_a_pytorch_flag_asks_otherwise(
    chat_model, tiny_model_dir, files
):
    from chat_e.__main__ import engine_kind, parse

    def kind(model, *flags):
        args, _ = parse(["--model", str(model), *flags])
        return engine_kind(args, str(model))

    assert kind(chat_model) == "llamacpp"
    assert kind(chat_model, "--quantize", "int8") == kind(chat_model, "--dtype", "bf16") == "torch"
    assert kind(chat_model, "--engine", "torch") == "torch"
    assert kind(tiny_model_dir) == "torch"  # BlenderBot: not llama.cpp's Llama graph
    assert kind(files["q8_0"], "--engine", "torch") == "llamacpp"  # a GGUF file has one engine
