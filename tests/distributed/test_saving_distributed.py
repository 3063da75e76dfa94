"""Saving and resuming under real 2-rank DeepSpeed runs (ZeRO-2 and ZeRO-3), checked on the artifacts.

One uninterrupted ZeRO-3 run is the reference: its final 16-bit save, its checkpoints and a gathered state dict
dumped by the training script. The other runs (killed-then-resumed, resumed past an epoch boundary, ZeRO-2) are
compared with it or with the stock ``save_model`` of the same trainer.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import BlenderbotForConditionalGeneration

from hf_ext.saving import checkpoints
from hf_ext.saving import writer as saving
from hf_ext.sizes import parse_bytes

from ..conftest import ROOT, TRAIN_LAUNCHER, launch_env, launcher_cmd, run
from ..saving_support import named_params

pytestmark = pytest.mark.distributed

SCRIPT = ROOT / "tests" / "distributed" / "workers" / "train_save.py"
TIMINGS = ("train_runtime", "train_samples_per_second", "train_steps_per_second")


def train(tiny_model_dir, out: Path, *extra: str, check: bool = True, **env) -> subprocess.CompletedProcess:
    cmd = [*launcher_cmd(TRAIN_LAUNCHER, SCRIPT), "--model", str(tiny_model_dir), "--out", str(out), *extra]
    if check:
        return run(cmd, **env)
    return subprocess.run(cmd, cwd=ROOT, env=launch_env(**env), capture_output=True, text=True, timeout=900)


def assert_equal_weights(expected: dict[str, torch.Tensor], model_dir: Path) -> None:
    """``model_dir`` loads with ``from_pretrained``, every tensor equals ``expected`` bit for bit, ties intact."""
    model = BlenderbotForConditionalGeneration.from_pretrained(model_dir)
    loaded = named_params(model)
    assert loaded.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(loaded[key], value), key
    shared = model.model.shared.weight
    assert model.lm_head.weight is shared and model.model.encoder.embed_tokens.weight is shared


def trainer_state(checkpoint: Path) -> dict:
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    state["log_history"] = [{k: v for k, v in e.items() if k not in TIMINGS} for e in state["log_history"]]
    return state


@pytest.fixture(scope="module")
def zero3_reference(tiny_model_dir, tmp_path_factory):
    """Uninterrupted ZeRO-3 run: 2 epochs of 8 steps, checkpoints every 4 steps (keep 2), 20KB shards."""
    root = tmp_path_factory.mktemp("zero3")
    train(
        tiny_model_dir,
        root / "out",
        "--stage",
        "3",
        "--dump",
        str(root / "trained.pt"),
        "--stock_save",
        str(root / "stock"),
    )
    return root


def test_zero3_streaming_save_full_shapes_and_reload(zero3_reference):
    out = zero3_reference / "out"
    info = json.loads((zero3_reference / "trained.pt.json").read_text())
    assert info["world_size"] == 2 and info["gather_16bit"] is True
    trained = torch.load(zero3_reference / "trained.pt")
    # full, non-empty shapes, and the same tensors as the stock save of the same trainer
    shapes = saving.saved_weight_shapes(out)
    assert shapes == saving.saved_weight_shapes(zero3_reference / "stock")
    assert all(0 not in shape for shape in shapes.values())
    buffers = {
        name for name, _ in BlenderbotForConditionalGeneration.from_pretrained(zero3_reference / "out").named_buffers()
    }
    assert set(shapes) <= set(trained) | buffers
    assert all(shapes[k] == tuple(trained[k].shape) for k in shapes if k in trained)
    assert_equal_weights(trained, out)
    assert_equal_weights(trained, zero3_reference / "stock")


def test_zero3_sharded_index(zero3_reference):
    from safetensors import safe_open

    out = zero3_reference / "out"
    index = json.loads((out / saving.SAFE_WEIGHTS_INDEX_NAME).read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and sorted(p.name for p in out.glob("model-*.safetensors")) == files
    total = 0
    for name in files:
        with safe_open(str(out / name), framework="pt") as f:
            keys = set(f.keys())
            assert keys == {k for k, v in index["weight_map"].items() if v == name}
            sizes = [f.get_tensor(k).numel() * f.get_tensor(k).element_size() for k in keys]
        assert sum(sizes) <= parse_bytes("20KB") or len(sizes) == 1
        total += sum(sizes)
    assert index["metadata"]["total_size"] == total


def test_zero3_checkpoints_complete_and_rotated(zero3_reference):
    out = zero3_reference / "out"
    assert [p.name for p in sorted(out.glob("*checkpoint-*"))] == ["checkpoint-12", "checkpoint-16"]
    trained = torch.load(zero3_reference / "trained.pt")
    for step in (12, 16):
        marker = json.loads((out / f"checkpoint-{step}" / checkpoints.CHECKPOINT_MARKER).read_text())
        assert marker["complete"] and marker["global_step"] == step and marker["world_size"] == 2
    assert_equal_weights(trained, out / "checkpoint-16")


def test_zero3_kill_during_save_then_resume(zero3_reference, tiny_model_dir, tmp_path):
    """Rank 1 is SIGKILLed while checkpoint-8 is being written; resume=True picks checkpoint-4 and, with 16-bit
    gathering switched off, the final output is consolidated from the ZeRO checkpoint — equal to the reference."""
    out = tmp_path / "out"
    killed = train(tiny_model_dir, out, "--stage", "3", check=False, HF_EXT_TEST_KILL_AT_STEP=8)
    assert killed.returncode != 0, killed.stdout[-2000:]
    assert (out / "tmp-checkpoint-8").is_dir() and not (out / "checkpoint-8").exists()
    assert checkpoints.last_complete_checkpoint(out, warn=False) == str(out / "checkpoint-4")
    assert (out / "checkpoint-4" / checkpoints.CHECKPOINT_MARKER).is_file()

    resumed = train(
        tiny_model_dir,
        out,
        "--stage",
        "3",
        "--gather",
        "off",
        "--resume",
        "true",
        "--dump",
        str(tmp_path / "final.pt"),
    )
    assert "Skipping the incomplete checkpoint" in resumed.stdout + resumed.stderr
    assert "consolidating fp32 weights from the ZeRO checkpoint" in resumed.stdout + resumed.stderr
    assert json.loads((tmp_path / "final.pt.json").read_text())["gather_16bit"] is False
    reference = torch.load(zero3_reference / "trained.pt")
    final = torch.load(tmp_path / "final.pt")
    for key, value in reference.items():
        assert torch.equal(final[key], value), key
    assert_equal_weights(reference, out)  # gathering off: fp32 consolidated output, loads and equals
    assert not list(out.glob("tmp-*"))
    ref_state = trainer_state(zero3_reference / "out" / "checkpoint-16")
    assert trainer_state(out / "checkpoint-16") == ref_state


def test_zero3_resume_past_epoch_boundary_misnamed_gather_flag(zero3_reference, tiny_model_dir, tmp_path):
    """Resume from step 12 (second epoch) on a fresh run whose config spells the gather flag DeepSpeed's way."""
    out = tmp_path / "out"
    checkpoint = zero3_reference / "out" / "checkpoint-12"
    extra = ("--stage", "3", "--gather", "misnamed", "--resume", str(checkpoint), "--dump", str(tmp_path / "final.pt"))
    train(tiny_model_dir, out, *extra)
    reference = torch.load(zero3_reference / "trained.pt")
    final = torch.load(tmp_path / "final.pt")
    for key, value in reference.items():
        assert torch.equal(final[key], value), key
    assert_equal_weights(reference, out)
    assert trainer_state(out / "checkpoint-16") == trainer_state(zero3_reference / "out" / "checkpoint-16")


def test_zero2_save_matches_stock_and_reloads(tiny_model_dir, tmp_path):
    out = tmp_path / "out"
    train(
        tiny_model_dir,
        out,
        "--stage",
        "2",
        "--epochs",
        "1",
        "--dump",
        str(tmp_path / "trained.pt"),
        "--stock_save",
        str(tmp_path / "stock"),
    )
    trained = torch.load(tmp_path / "trained.pt")
    ours, stock = saving.saved_weight_shapes(out), saving.saved_weight_shapes(tmp_path / "stock")
    # the stock ZeRO-2 save also stores the tied copies (lm_head, embed_tokens); they re-tie on load either way
    assert set(ours) <= set(stock) and all(stock[k] == s for k, s in ours.items())
    assert set(stock) - set(ours) <= saving.tied_target_keys(BlenderbotForConditionalGeneration.from_pretrained(out))
    assert_equal_weights(trained, out)
    assert_equal_weights(trained, tmp_path / "stock")
    assert len(json.loads((out / saving.SAFE_WEIGHTS_INDEX_NAME).read_text())["weight_map"]) == len(
        saving.saved_weight_shapes(out)
    )
    assert sorted(p.name for p in out.glob("*checkpoint-*")) == ["checkpoint-4", "checkpoint-8"]


def greedy(model, prompts: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.eval().generate(prompts, num_beams=1, do_sample=False, min_length=0, max_new_tokens=12)


def test_export_round_trip(zero3_reference, tiny_model_dir, tmp_path):
    """`hf-ext export` from the 16-bit save and from a ZeRO-only checkpoint generates what the trained model does."""
    import shutil

    from transformers import AutoTokenizer

    from hf_ext.saving.export import export

    trained = BlenderbotForConditionalGeneration.from_pretrained(tiny_model_dir)
    trained.load_state_dict(torch.load(zero3_reference / "trained.pt"), strict=False)  # buffers are not dumped
    prompts = torch.randint(4, trained.config.vocab_size, (3, 10), generator=torch.Generator().manual_seed(1))
    expected = greedy(trained, prompts)

    zero_only = tmp_path / "zero_only"
    zero_only.mkdir()
    for name in (
        "global_step16",
        "latest",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        src = zero3_reference / "out" / "checkpoint-16" / name
        (shutil.copytree if src.is_dir() else shutil.copy)(src, zero_only / name)
    cli = run(
        [
            str(Path(sys.executable).parent / "hf-ext"),
            "export",
            str(zero3_reference / "out"),
            "--out",
            str(tmp_path / "from_16bit"),
        ]
    )
    assert str(tmp_path / "from_16bit") in cli.stdout
    export(zero_only, tmp_path / "from_zero")
    export(zero3_reference / "out", tmp_path / "bf16", dtype="bf16")
    for name in ("from_16bit", "from_zero"):
        exported = BlenderbotForConditionalGeneration.from_pretrained(tmp_path / name)
        assert torch.equal(greedy(exported, prompts), expected), name
        assert exported.generation_config.num_beams == trained.generation_config.num_beams
        tokenizer = AutoTokenizer.from_pretrained(tmp_path / name)
        assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(tiny_model_dir).get_vocab()
    bf16 = BlenderbotForConditionalGeneration.from_pretrained(tmp_path / "bf16", dtype="auto")
    for key, value in named_params(trained).items():
        assert torch.equal(named_params(bf16)[key], value.to(torch.bfloat16)), key


def test_zero3_streaming_save_of_a_decoder_only_chat_model(tiny_chat_model_dir, tmp_path):
    """Full fine-tuning of the tiny chat model (tied embeddings, grouped-query attention) under ZeRO-3: the streamed
    16-bit save has the stock save's tensors and reloads bit for bit, with its tie intact."""
    from transformers import AutoModelForCausalLM

    train(
        tiny_chat_model_dir, tmp_path / "out", "--stage", "3", "--epochs", "1", "--dump", str(tmp_path / "trained.pt"),
        "--stock_save", str(tmp_path / "stock"), "--max_shard_size", "100KB",
    )  # fmt: skip
    trained = torch.load(tmp_path / "trained.pt")
    assert saving.saved_weight_shapes(tmp_path / "out") == saving.saved_weight_shapes(tmp_path / "stock")
    for model_dir in (tmp_path / "out", tmp_path / "stock"):
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        loaded = named_params(model)
        assert loaded.keys() == trained.keys()
        assert all(torch.equal(loaded[k], v) for k, v in trained.items())
        assert model.lm_head.weight is model.model.embed_tokens.weight
    initial = named_params(AutoModelForCausalLM.from_pretrained(tiny_chat_model_dir))
    assert not torch.equal(initial["model.layers.0.mlp.up_proj.weight"], trained["model.layers.0.mlp.up_proj.weight"])
