#!/usr/bin/env python
"""Run the tests that compare floats exactly under every CPU kernel setting and thread count, and write the table.

    python scripts/kernel_matrix.py --out runs/kernel_matrix.json --doc docs/testing.md      (or: make test-kernels)

torch picks its CPU kernels by ``ATEN_CPU_CAPABILITY`` (``default``, ``avx2``, ``avx512``; unset: the best the CPU
has) and splits work by its thread count, so an exact comparison between two computations holds on every machine
only if it holds in every cell. Each cell runs the tests of ``EXACT`` in one pytest process with
``ATEN_CPU_CAPABILITY`` set (or unset: the machine's own) and ``OMP_NUM_THREADS`` = ``HF_EXT_TEST_THREADS`` = the
thread count, which the tests' launcher passes to every rank (tests/conftest.py). The capability each cell really
ran is read back from torch in a process started the same way. ``--doc`` replaces the table between the
``kernel-matrix`` markers of docs/testing.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

from hf_ext.atomic import write_text_atomically

ROOT = Path(__file__).resolve().parents[1]

#: every test that compares floats exactly (==, torch.equal, rtol=0), with what its two sides are. "computed": two
#: computations (two code paths, or one path run twice) whose results are compared: kernels and threads could move
#: them. "stored": a tensor against its own copy through a file, a gather or a cast, with no arithmetic between them.
EXACT = {
    # computed
    "tests/unit/test_heldout.py::test_a_model_that_prefers_chosen_in_3_of_4_pairs_reports_75_percent": (
        "computed",
        "two replies of the same tokens tie per token (float64 sums of equal log-probabilities)",
    ),
    "tests/unit/test_padding_free.py::test_no_token_attends_across_rows": (
        "computed",
        "a packed row's logits when another row of the pack changes",
    ),
    "tests/peer/test_peer_checkpointing.py::test_resume_from_checkpoint_true_takes_the_newest_and_ends_as_the_uninterrupted_run": (  # noqa: E501
        "computed",
        "resumed weights against the uninterrupted run's, stock and hf-ext",
    ),
    "tests/integration/test_saving.py::test_trainer_without_deepspeed_saves_resumes_and_rotates": (
        "computed",
        "resumed weights against the uninterrupted run's and stock's",
    ),
    "tests/integration/test_smollm2_asset.py::test_saved_checkpoint_computes_the_gguf_logits": (
        "computed",
        "logits of the converted checkpoint against the GGUF reader's model",
    ),
    "tests/integration/test_bleu_eval_training.py": (
        "computed",
        "generations during evaluation against stock generate() / predict_with_generate",
    ),
    "tests/integration/test_trl_sft_bleu.py": ("computed", "TRL SFT evaluation's generations against generate()"),
    "tests/app/test_app_engine.py": ("computed", "Chat-E's greedy replies against stock generate()"),
    "tests/app/test_app_server.py::test_served_replies_equal_stock_generate": (
        "computed",
        "served replies against stock generate()",
    ),
    "tests/app/test_openai_api.py::test_replies_equal_stock_generate_streamed_or_not": (
        "computed",
        "API replies against stock generate()",
    ),
    "tests/distributed/test_trl.py::test_per_step_losses_equal_stock_trl": (
        "computed",
        "per-step losses, stock TRL against hf-ext (within 1e-6 relative, the test's docstring)",
    ),
    "tests/distributed/test_bleu_eval_distributed.py::test_zero3_gathered_once_generates_the_same_and_training_continues_bit_identically": (  # noqa: E501
        "computed",
        "weights after evaluating with one gather against evaluating without it",
    ),
    "tests/distributed/test_fsdp.py::test_resume_is_bit_identical": (
        "computed",
        "FSDP2 resumed weights against the uninterrupted run's",
    ),
    "tests/distributed/test_fsdp.py::test_evaluation_before_training": (
        "computed",
        "FSDP2 training after an evaluation against training without it",
    ),
    "tests/distributed/test_peft_checkpoint.py::test_adapter_reloads_on_fresh_base_with_same_outputs": (
        "computed",
        "logits of the reloaded adapter against the trained model's",
    ),
    "tests/distributed/test_saving_distributed.py::test_export_round_trip": (
        "computed",
        "greedy tokens of the exported models against the trained model's",
    ),
    # stored
    "tests/unit/test_saving_writer.py": ("stored", "streamed shards against the model's tensors and stock's save"),
    "tests/unit/test_safe_loading.py": ("stored", "tensors loaded back against those saved"),
    "tests/unit/test_training_args.py::test_save_model_follows_save_max_shard_size": (
        "stored",
        "sharded save against the state dict",
    ),
    "tests/unit/test_tiny_model.py": ("stored", "two seeded builds' weights (the RNG's draws, no arithmetic)"),
    "tests/integration/test_atomic_writes.py": ("stored", "weights after a killed export: the old or the new"),
    "tests/distributed/test_trl.py::test_the_saved_model_loads_and_equals_the_gathered_weights": (
        "stored",
        "saved model against the gathered weights",
    ),
    "tests/distributed/test_fsdp.py::test_save_loads_and_equals_torch_full_state_dict": (
        "stored",
        "hf-ext's FSDP2 save against torch's full state dict",
    ),
}

CAPABILITIES = ("default", "avx2", "")  # "": unset, the machine's own
THREADS = (1, 2)
BEGIN, END = "<!-- kernel-matrix -->", "<!-- /kernel-matrix -->"


def cell_env(capability: str, threads: int) -> dict:
    env = dict(os.environ)
    env.pop("ATEN_CPU_CAPABILITY", None)
    if capability:
        env["ATEN_CPU_CAPABILITY"] = capability
    env["OMP_NUM_THREADS"] = env["HF_EXT_TEST_THREADS"] = str(threads)
    return env


def capability_in_force(env: dict) -> str:
    code = "import torch; print(torch.backends.cpu.get_cpu_capability(), torch.get_num_threads())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return out.stdout.split()[0]


def test_of(case) -> str:
    """The EXACT key a junit test case belongs to."""
    path = case.get("classname", "").replace(".", "/")
    name = re.sub(r"\[.*\]$", "", case.get("name", ""))
    for key in EXACT:
        if key == f"{path}.py::{name}" or key == f"{path}.py":
            return key
    return f"{path}.py::{name}"


def run_cell(capability: str, threads: int, work: Path, tests: list[str]) -> dict:
    env = cell_env(capability, threads)
    junit = work / f"{capability or 'native'}-{threads}.xml"
    started = time.monotonic()
    cmd = [sys.executable, "-m", "pytest", *tests, "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    outcomes: dict[str, list[str]] = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        outcome = "fail" if failed else "skip" if case.find("skipped") is not None else "pass"
        outcomes.setdefault(test_of(case.attrib), []).append(outcome)
    return {
        "capability_set": capability or "(unset)",
        "capability_in_force": capability_in_force(env),
        "threads": threads,
        "exit_code": proc.returncode,
        "seconds": round(time.monotonic() - started, 1),
        "summary": proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "",
        "outcomes": outcomes,
    }


def verdict(results: list[str] | None) -> str:
    if not results:
        return "not run"
    if all(r == "pass" for r in results):
        return f"pass ({len(results)})" if len(results) > 1 else "pass"
    return f"**{results.count('fail')} fail, {results.count('skip')} skip** of {len(results)}"


def table(cells: list[dict]) -> str:
    head = [f"{c['capability_in_force']}, {c['threads']} thr" for c in cells]
    lines = [
        "| test | compares | kind | " + " | ".join(head) + " |",
        "|---|---|---|" + "---|" * len(cells),
    ]
    for key, (kind, what) in EXACT.items():
        row = [verdict(c["outcomes"].get(key)) for c in cells]
        lines.append(f"| `{key}` | {what} | {kind} | " + " | ".join(row) + " |")
    lines.append("| *cell's wall time* | | | " + " | ".join(f"{c['seconds']:.0f} s" for c in cells) + " |")
    return "\n".join(lines)


def write_doc(doc: Path, body: str) -> None:
    text = doc.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    write_text_atomically(doc, text[:start] + "\n" + body + "\n" + text[end:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--capabilities", default=",".join(c or "native" for c in CAPABILITIES),
                        help="comma-separated: default, avx2, avx512, native (unset)")  # fmt: skip
    parser.add_argument("--threads", default=",".join(map(str, THREADS)), help="comma-separated threads per rank")
    parser.add_argument("--out", default="runs/kernel_matrix.json")
    parser.add_argument("--select", default="", help="only the tests whose id contains this (a quick look)")
    parser.add_argument("--doc", default=None, help="replace the table in this markdown file (docs/testing.md)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    cells = []
    capabilities = ["" if c == "native" else c for c in args.capabilities.split(",")]
    grid = [(c, int(t)) for c in capabilities for t in args.threads.split(",")]
    for i, (capability, threads) in enumerate(grid, 1):
        print(
            f"[{i}/{len(grid)}] ATEN_CPU_CAPABILITY={capability or '(unset)'}, {threads} thread(s) per process",
            flush=True,
        )
        cell = run_cell(capability, threads, out.parent, [key for key in EXACT if args.select in key])
        print(f"    {cell['capability_in_force']}: {cell['summary']} ({cell['seconds']:.0f} s)", flush=True)
        cells.append(cell)
        write_text_atomically(out, json.dumps({"cpu": cpu_name(), "cells": cells}, indent=1))
    body = f"Measured on: {cpu_name()}.\n\n" + table(cells)
    print(body)
    if args.doc:
        write_doc(Path(args.doc), body)
    return 0 if all(c["exit_code"] == 0 for c in cells) else 1


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


if __name__ == "__main__":
    sys.exit(main())
