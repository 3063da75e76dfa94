"""FSDP2 on 2 (and 4) CPU ranks under torchrun, with the tiny BlenderBot (tied embeddings shared by the encoder, the
decoder and the LM head, which accelerate's own FSDP2 grouping cannot wrap):

* stock transformers given the same ``fsdp="full_shard"`` trains DDP here (the engine it reports), hf-ext really
  shards: each rank holds half of every parameter, the two halves are the full tensor, and each layer is its own
  FSDP unit although BlenderBot declares no ``_no_split_modules``;
* the save loads with ``from_pretrained`` and equals torch's own full state dict (``get_model_state_dict``) bit for
  bit;
* a resume from checkpoint-4 on two nodes (two torchrun agents of one rank each, as in
  tests/distributed/test_multinode.py) trains steps 5-8 only and ends bit-identical to the uninterrupted run on one;
* the same checkpoint resumed on 4 ranks under hybrid sharding with a sharding factor of 2 (each parameter split
  over 2 ranks, the shards replicated across the two groups) lands within float tolerance of it
  (torch.distributed.checkpoint reshards);
* an evaluation before any training (stock refuses to prepare an FSDP2 model without its optimizer) gives the plain
  model's loss, and the training after it is bit-identical to one without it;
* under bf16 mixed precision the save is 16-bit: torch's full state dict (the fp32 master weights) cast to bf16.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ..conftest import ROOT, TRAIN_LAUNCHER, launcher_cmd, run
from ..saving_support import parameter_names
from .test_multinode import two_nodes

pytestmark = pytest.mark.distributed

SCRIPT = ROOT / "tests" / "distributed" / "workers" / "train_save.py"


def train(model_dir, out: Path, *extra: str, nproc: int = 2) -> dict:
    out.mkdir(parents=True)
    run([*launcher_cmd(TRAIN_LAUNCHER, SCRIPT, nproc=nproc), "--model", str(model_dir), "--out", str(out / "out"),
         "--no_dropout", "--epochs", "1", "--save_total_limit", "3", "--dump", str(out / "trained.pt"), *extra])  # fmt: skip
    return json.loads((out / "trained.pt.json").read_text())


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp")
    full = train(tiny_model_dir, root / "full", "--fsdp", "full_shard", "--samples", str(root / "full" / "samples"),
                 "--stock_fsdp_check", str(root / "stock.json"))  # fmt: skip
    # each node's one rank would take the node's cores; here it takes what each rank of the one-node run took, so that
    # both runs compute with the same kernels' summation order
    two_nodes(tiny_model_dir, root / "resumed", "--fsdp", "full_shard", "--samples", str(root / "resumed" / "samples"),
              "--resume", str(root / "full" / "out" / "checkpoint-4"), OMP_NUM_THREADS=full["run"]["torch_threads"])  # fmt: skip
    return root, full, json.loads((root / "resumed" / "trained.pt.json").read_text())


def shards(run_dir: Path, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(run_dir / f"trained.pt.rank{rank}.pt")


def test_stock_trains_ddp_where_hf_ext_shards(runs, tiny_model_dir):
    root, full, _ = runs
    stock = json.loads((root / "stock.json").read_text())
    assert stock == {
        "engine": "DistributedDataParallel",
        "dtensors": 0,
        "distributed_type": "DistributedType.MULTI_CPU",
    }
    assert full["run"]["engine"] == "FSDP2"
    assert full["run"]["fsdp"] == {"sharding": "full_shard", "sharding_factor": 2, "replicas": 1}
    # BlenderBot declares no _no_split_modules: each encoder and decoder layer is still its own unit (gathered alone)
    config = json.loads((root / "full" / "out" / "config.json").read_text())
    layers = [f"model.encoder.layers.{i}" for i in range(config["encoder_layers"])]
    layers += [f"model.decoder.layers.{i}" for i in range(config["decoder_layers"])]
    assert set(layers) <= set(full["fsdp_units"]) and "" in full["fsdp_units"]
    weights = torch.load(root / "full" / "trained.pt")
    assert set(weights) == parameter_names(tiny_model_dir)
    rank0, rank1 = shards(root / "full", 0), shards(root / "full", 1)
    held = parameter_names(tiny_model_dir, remove_duplicate=True)  # each parameter once, a tied one by its first name
    assert set(rank0) == set(rank1) == held  # every parameter, on each rank
    for name, local in rank0.items():
        whole = weights[name]
        assert local.shape[0] == (whole.shape[0] + 1) // 2, name  # each rank holds half of dim 0
        assert torch.equal(torch.cat([local, rank1[name]]), whole), name


def test_save_loads_and_equals_torch_full_state_dict(runs):
    from transformers import AutoModelForSeq2SeqLM

    root, full, _ = runs
    weights = torch.load(root / "full" / "trained.pt")  # torch's get_model_state_dict(full_state_dict=True)
    loaded = AutoModelForSeq2SeqLM.from_pretrained(root / "full" / "out")
    named = dict(loaded.named_parameters(remove_duplicate=False))
    assert set(named) == set(weights)
    for name, value in weights.items():
        assert torch.equal(named[name], value), name
    config = json.loads((root / "full" / "out" / "config.json").read_text())
    assert config["architectures"] == ["BlenderbotForConditionalGeneration"]  # not FSDP2's FSDPBlenderbot... class
    checkpoint = root / "full" / "out" / "checkpoint-4"
    assert (checkpoint / "pytorch_model_fsdp_0").is_dir() and (checkpoint / "optimizer_0").is_dir()  # per-rank shards
    assert AutoModelForSeq2SeqLM.from_pretrained(checkpoint) is not None  # every checkpoint loads too


def test_resume_is_bit_identical(runs, tiny_model_dir):
    root, full, resumed = runs
    from safetensors.torch import load_file

    a, b = torch.load(root / "full" / "trained.pt"), torch.load(root / "resumed" / "trained.pt")
    assert set(a) == set(b) == parameter_names(tiny_model_dir)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert resumed["global_step"] == full["global_step"] == 8
    run = resumed["run"]
    assert (run["launcher"], run["world_size"], run["nodes"], run["ranks_per_node"]) == ("torchrun", 2, 2, 1)
    assert (run["engine"], run["fsdp"]["sharding_factor"]) == ("FSDP2", 2)
    steps = sorted({step for rank in (0, 1) for step, _ in
                    json.loads((root / "resumed" / f"samples.rank{rank}.json").read_text())})  # fmt: skip
    assert steps == [5, 6, 7, 8]  # the resumed run trained steps 5-8 only
    losses = [h["loss"] for h in full["log_history"] if "loss" in h]
    assert losses == [h["loss"] for h in resumed["log_history"] if "loss" in h]
    at_4 = {}
    for file in (root / "full" / "out" / "checkpoint-4").glob("model-*.safetensors"):
        at_4.update(load_file(file))
    assert any(not torch.equal(at_4[name], a[name]) for name in at_4)  # steps 5-8 moved the weights


def test_resume_on_four_ranks_under_hybrid_sharding(runs, tiny_model_dir, tmp_path):
    # the refusal of a micro-batch that cannot keep the global batch: tests/unit/test_resume_batch.py
    root, full, _ = runs
    checkpoint = str(root / "full" / "out" / "checkpoint-4")  # 2 ranks x micro-batch 2: a global batch of 4
    resumed = train(tiny_model_dir, tmp_path / "four", "--fsdp", "hybrid_shard", "--fsdp_config",
                    '{"sharding_factor": 2}', "--batch", "1", "--resume", checkpoint, nproc=4)  # fmt: skip
    assert resumed["world_size"] == 4 and resumed["global_step"] == 8
    assert resumed["run"]["fsdp"] == {"sharding": "hybrid_shard", "sharding_factor": 2, "replicas": 2}
    losses = [h["loss"] for h in full["log_history"] if "loss" in h]
    assert [h["loss"] for h in resumed["log_history"] if "loss" in h] == pytest.approx(losses, abs=1e-5)
    a, weights = torch.load(root / "full" / "trained.pt"), torch.load(tmp_path / "four" / "trained.pt")
    assert set(a) == set(weights) == parameter_names(tiny_model_dir)
    assert max((a[name] - weights[name]).abs().max().item() for name in a) <= 2e-6  # fp32 sums in another order
    local = [shards(tmp_path / "four", rank) for rank in range(4)]
    names = parameter_names(tiny_model_dir, remove_duplicate=True)
    assert [set(held) for held in local] == [names] * 4  # every parameter, on each rank
    for name in sorted(names):
        whole = weights[name]
        assert local[0][name].shape[0] == (whole.shape[0] + 1) // 2, name  # split over a group of 2 ranks
        assert torch.equal(local[0][name], local[2][name]) and torch.equal(local[1][name], local[3][name]), name
        assert torch.equal(torch.cat([local[0][name], local[1][name]]), whole), name


def worker_rows(n: int, vocab: int) -> list[dict]:
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_save_worker", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.synthetic_dataset(n, vocab)


def test_evaluation_before_training(runs, tiny_model_dir, tmp_path):
    from transformers import AutoModelForSeq2SeqLM

    root, full, _ = runs
    first = train(tiny_model_dir, tmp_path / "eval_first", "--fsdp", "full_shard", "--eval_first")
    # the oracle: one plain forward of the untrained model over the same 32 rows (no Trainer, no FSDP); every row has
    # 9 label tokens, so the mean over eval batches is the mean over all tokens
    model = AutoModelForSeq2SeqLM.from_pretrained(tiny_model_dir, dropout=0.0, attention_dropout=0.0).eval()
    rows = worker_rows(32, model.config.vocab_size)
    batch = {key: torch.tensor([row[key] for row in rows]) for key in rows[0]}
    with torch.no_grad():
        expected = model(**batch).loss.item()
    assert abs(first["first_eval"]["eval_loss"] - expected) < 1e-5, (first["first_eval"], expected)
    assert "eval_bleu" in first["first_eval"]  # the generation eval ran too, on the sharded model
    assert first["run"]["engine"] == "FSDP2"
    a, b = torch.load(root / "full" / "trained.pt"), torch.load(tmp_path / "eval_first" / "trained.pt")
    assert set(a) == set(b) == parameter_names(tiny_model_dir)
    assert all(torch.equal(a[name], b[name]) for name in a)  # training as if never evaluated


def test_bf16_save_is_16_bit_master_weights(tiny_model_dir, tmp_path):
    from safetensors import safe_open
    from transformers import AutoModelForSeq2SeqLM

    train(tiny_model_dir, tmp_path / "bf16", "--fsdp", "full_shard", "--bf16", "--save_steps", "100")
    masters = torch.load(tmp_path / "bf16" / "trained.pt")  # torch's full state dict: the fp32 sharded parameters
    assert set(masters) == parameter_names(tiny_model_dir)
    assert all(t.dtype == torch.float32 for t in masters.values())
    out = tmp_path / "bf16" / "out"
    stored = {}
    for file in out.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            stored.update({k: f.get_tensor(k) for k in f.keys()})
    assert stored and {t.dtype for t in stored.values() if t.is_floating_point()} == {torch.bfloat16}
    params = [name for name in stored if name in masters]
    # every parameter once (a tied one under its first name), and the final_logits_bias buffer
    held = parameter_names(tiny_model_dir, remove_duplicate=True)
    assert set(params) == held and set(stored) - set(params) == {"final_logits_bias"}
    for name in params:
        assert torch.equal(stored[name], masters[name].to(torch.bfloat16)), name
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = AutoModelForSeq2SeqLM.from_pretrained(out)
    assert loaded.dtype == torch.bfloat16
