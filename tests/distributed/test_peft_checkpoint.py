"""PEFT (LoRA on q/v + a ``modules_to_save``) under 2-rank ZeRO-3, 2-rank FSDP2 and on 1 rank without DeepSpeed:
adapter saves with full shapes, adapter-sized checkpoints, and resumes across world sizes (2→1, 1→2) and engines that
match uninterrupted runs."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import BlenderbotForConditionalGeneration

from hf_ext import peft as peft_checkpoint

from ..conftest import ROOT, TRAIN_LAUNCHER, launcher_cmd, run

pytestmark = pytest.mark.distributed

SCRIPT = ROOT / "tests" / "distributed" / "workers" / "train_save.py"
LORA = ("--lora", "--modules_to_save", "decoder.layer_norm", "--epochs", "1", "--save_total_limit", "3")
TOLERANCE = 1e-6


# engine: (launcher, flags), the same global batch, 4, on each: ZeRO-3 and FSDP2 on 2 ranks, 1 process without either
ENGINES = {"zero3": (TRAIN_LAUNCHER, ("--stage", "3")), "fsdp": (TRAIN_LAUNCHER, ("--fsdp", "full_shard")),
           "single": ("python", ("--no_ds", "--batch", "4"))}  # fmt: skip


def command(engine: str, model_dir, out: Path, dump: Path) -> list[str]:
    launcher, flags = ENGINES[engine]
    return [*launcher_cmd(launcher, SCRIPT), "--model", str(model_dir), "--out", str(out), "--dump", str(dump), *flags]


def train(engine: str, tiny_model_dir, out: Path, dump: Path, *extra: str) -> subprocess.CompletedProcess:
    return run([*command(engine, tiny_model_dir, out, dump), *LORA, *extra])


@pytest.fixture(scope="module")
def lora_zero3(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_zero3")
    train("zero3", tiny_model_dir, root / "out", root / "trained.pt")
    return root


@pytest.fixture(scope="module")
def lora_single(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_single")
    train("single", tiny_model_dir, root / "out", root / "trained.pt")
    return root


def trainable(state: dict) -> dict:
    return {k: v for k, v in state.items() if "lora_" in k or "modules_to_save" in k}


def fresh_peft_model(tiny_model_dir):
    from peft import LoraConfig, get_peft_model

    base = BlenderbotForConditionalGeneration.from_pretrained(tiny_model_dir, dropout=0.0, attention_dropout=0.0)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], modules_to_save=["decoder.layer_norm"])
    return get_peft_model(base, config)


def assert_close(expected: dict, actual: dict) -> None:
    assert expected.keys() == actual.keys()
    worst = max((expected[k] - actual[k]).abs().max().item() for k in expected)
    assert worst <= TOLERANCE, worst


def test_lora_trains_adapter_only_and_checkpoint_is_adapter_sized(lora_zero3, tiny_model_dir):
    trained = torch.load(lora_zero3 / "trained.pt")
    assert json.loads((lora_zero3 / "trained.pt.json").read_text())["world_size"] == 2
    initial = dict(fresh_peft_model(tiny_model_dir).named_parameters(remove_duplicate=False))
    for name, value in trained.items():
        if name in trainable(trained):
            if "lora_A" not in name:  # lora_B starts at zero, modules_to_save at the base values: both must move
                assert not torch.equal(value, initial[name]), name
        else:
            assert torch.equal(value, initial[name]), name  # the base model did not change

    checkpoint = lora_zero3 / "out" / "checkpoint-4"
    assert not (checkpoint / peft_checkpoint.LEGACY_TRAINABLE_STATE_NAME).exists()  # tensors + JSON, no pickle
    state = peft_checkpoint.read_trainable_state(checkpoint)
    assert set(state["params"]) == {
        k for k, p in fresh_peft_model(tiny_model_dir).named_parameters() if p.requires_grad
    }
    assert state["world_size"] == 2 and state["optimizer_step"] == 4
    assert all(set(entry) == {"param", "exp_avg", "exp_avg_sq"} for entry in state["params"].values())
    assert not list(checkpoint.glob("global_step*")) and not list(checkpoint.glob("model*.safetensors"))
    shapes = peft_checkpoint.verify_adapter(checkpoint)
    layer_norm = [k for k in shapes if "decoder.layer_norm" in k]
    assert layer_norm and all(shapes[k] == (32,) for k in layer_norm)  # full shapes under ZeRO-3 (peft #2450)
    stored = sum(p.stat().st_size for p in checkpoint.glob("*") if p.suffix in (".safetensors", ".pt"))
    base_bytes = (Path(tiny_model_dir) / "model.safetensors").stat().st_size
    assert stored < base_bytes / 2, (stored, base_bytes)


def test_adapter_reloads_on_fresh_base_with_same_outputs(lora_zero3, tiny_model_dir):
    from peft import PeftModel

    trained = fresh_peft_model(tiny_model_dir)
    trained.load_state_dict(torch.load(lora_zero3 / "trained.pt"), strict=False)
    base = BlenderbotForConditionalGeneration.from_pretrained(tiny_model_dir, dropout=0.0, attention_dropout=0.0)
    reloaded = PeftModel.from_pretrained(base, lora_zero3 / "out")
    ids = torch.randint(4, 1000, (2, 10), generator=torch.Generator().manual_seed(0))
    labels = torch.randint(4, 1000, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = trained.eval()(input_ids=ids, labels=labels).logits
        actual = reloaded.eval()(input_ids=ids, labels=labels).logits
    assert torch.equal(expected, actual)


def test_resume_one_rank_to_two(lora_single, tiny_model_dir, tmp_path):
    """(2 ranks to 1: ZeRO-3 of the chat model and FSDP2 of BlenderBot, below.)"""
    train(
        "zero3",
        tiny_model_dir,
        tmp_path / "out",
        tmp_path / "final.pt",
        "--resume",
        str(lora_single / "out" / "checkpoint-4"),
    )
    assert_close(trainable(torch.load(lora_single / "trained.pt")), trainable(torch.load(tmp_path / "final.pt")))


@pytest.fixture(scope="module")
def lora_fsdp(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora_fsdp")
    train("fsdp", tiny_model_dir, root / "out", root / "trained.pt")
    return root


def test_lora_under_fsdp_trains_as_zero3_and_resumes_on_one_rank(lora_fsdp, lora_zero3, tiny_model_dir, tmp_path):
    info = json.loads((lora_fsdp / "trained.pt.json").read_text())
    assert info["run"]["engine"] == "FSDP2" and info["run"]["fsdp"]["sharding_factor"] == 2
    # DeepSpeed ZeRO-3 trained the same adapter on the same data: FSDP2 must land on the same weights
    fsdp_trained = trainable(torch.load(lora_fsdp / "trained.pt"))
    assert_close(trainable(torch.load(lora_zero3 / "trained.pt")), fsdp_trained)
    checkpoint = lora_fsdp / "out" / "checkpoint-4"
    assert not list(checkpoint.glob("pytorch_model_fsdp*")) and not list(checkpoint.glob("model*.safetensors"))
    shapes = peft_checkpoint.verify_adapter(checkpoint)
    assert all(shapes[k] == (32,) for k in shapes if "decoder.layer_norm" in k)  # full shapes, not a rank's shard
    state = peft_checkpoint.read_trainable_state(checkpoint)
    assert state["world_size"] == 2 and state["optimizer_step"] == 4
    first = next(iter(state["params"].values()))
    assert first["exp_avg"].shape == first["param"].shape  # the whole optimizer state, gathered from the shards
    train("single", tiny_model_dir, tmp_path / "out", tmp_path / "final.pt", "--resume", str(checkpoint))
    assert_close(fsdp_trained, trainable(torch.load(tmp_path / "final.pt")))


def check_merged_export(trained, src: Path, out: Path, model_cls, **generate_kwargs) -> None:
    """``hf-ext export --merge`` of ``src``: no LoRA weight left, and greedy generations equal ``trained``'s."""
    from hf_ext.saving.export import export

    export(src, out, merge=True)
    merged = model_cls.from_pretrained(out)
    assert not any("lora_" in k for k, _ in merged.named_parameters())
    prompts = torch.randint(4, 1000, (3, 10), generator=torch.Generator().manual_seed(2))
    kwargs = dict(num_beams=1, do_sample=False, max_new_tokens=12, **generate_kwargs)
    with torch.no_grad():
        assert torch.equal(
            merged.eval().generate(prompts, **kwargs), trained.eval().generate(input_ids=prompts, **kwargs)
        )


def test_export_merged_adapter_generates_like_trained_model(lora_zero3, tiny_model_dir, tmp_path):
    trained = fresh_peft_model(tiny_model_dir)
    trained.load_state_dict(torch.load(lora_zero3 / "trained.pt"), strict=False)
    check_merged_export(
        trained, lora_zero3 / "out", tmp_path / "merged", BlenderbotForConditionalGeneration, min_length=0
    )


# ---- a decoder-only chat model: LoRA on every attention and MLP projection -----------------------------------------
CHAT_LORA = ("--lora", "--lora_targets", "all-linear", "--epochs", "1", "--save_total_limit", "3", "--padding_free")


def chat_train(engine: str, model_dir, out: Path, dump: Path, *extra: str) -> subprocess.CompletedProcess:
    return run([*command(engine, model_dir, out, dump), *CHAT_LORA, *extra])


def fresh_chat_peft_model(model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    return get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), config)


@pytest.fixture(scope="module")
def chat_lora_zero3(tiny_chat_model_dir, tmp_path_factory):
    # padding-free: rows of 5-37 tokens flattened per micro-batch, the batch_rebalance sampler balancing tokens
    root = tmp_path_factory.mktemp("chat_lora_zero3")
    chat_train("zero3", tiny_chat_model_dir, root / "out", root / "trained.pt", "--samples", str(root / "samples"))
    return root


def samples_by_step(prefix: Path) -> dict[int, list[int]]:
    steps: dict[int, list[int]] = {}
    for path in sorted(prefix.parent.glob(f"{prefix.name}.rank*.json")):
        for step, sample in json.loads(path.read_text()):
            steps.setdefault(step, []).append(sample)
    return {step: sorted(ids) for step, ids in sorted(steps.items())}


def test_chat_model_lora_adapter_checkpoint_resumes_two_ranks_to_one(chat_lora_zero3, tiny_chat_model_dir, tmp_path):
    trained = torch.load(chat_lora_zero3 / "trained.pt")
    adapted = {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in trainable(trained)}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    checkpoint = chat_lora_zero3 / "out" / "checkpoint-4"
    assert not list(checkpoint.glob("global_step*")) and not list(checkpoint.glob("model*.safetensors"))
    assert peft_checkpoint.verify_adapter(checkpoint)
    chat_train("single", tiny_chat_model_dir, tmp_path / "out", tmp_path / "final.pt", "--resume", str(checkpoint),
               "--samples", str(tmp_path / "samples"))  # fmt: skip
    assert_close(trainable(trained), trainable(torch.load(tmp_path / "final.pt")))
    # the padding-free run on one rank after the resume: steps 5-8 on the rows the two ranks had there, each row of
    # the epoch once over both runs
    before, after = samples_by_step(chat_lora_zero3 / "samples"), samples_by_step(tmp_path / "samples")
    assert after == {step: ids for step, ids in before.items() if step > 4}
    seen = [i for step, ids in before.items() if step <= 4 for i in ids] + [i for ids in after.values() for i in ids]
    assert sorted(seen) == list(range(32))


def test_chat_model_export_merge_generates_like_the_trained_model(chat_lora_zero3, tiny_chat_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    trained = fresh_chat_peft_model(tiny_chat_model_dir)
    trained.load_state_dict(torch.load(chat_lora_zero3 / "trained.pt"), strict=False)
    check_merged_export(
        trained, chat_lora_zero3 / "out", tmp_path / "merged", AutoModelForCausalLM, repetition_penalty=1.0
    )
    assert (tmp_path / "merged" / "chat_template.jinja").is_file()  # the tokenizer and its template came along
