"""bench_trl's own machinery, without a launch: its rows, the config both paths get, the settings both paths share,
the check that the saved models are equal, and the summary grouped by trainer."""

from __future__ import annotations

import types

import pytest

from benchmarks import bench_train, bench_trl


class ByteTokenizer:
    """Decodes an id to its characters (id 65 -> "A"): enough to see which ids went where."""

    def __len__(self):
        return 128

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def test_sft_rows_are_seeded_token_ids_only():
    rows = bench_trl.sft_rows(5, vocab=100, seq_len=12)
    assert rows == bench_trl.sft_rows(5, vocab=100, seq_len=12)
    assert all(set(r) == {"input_ids"} and len(r["input_ids"]) == 12 and min(r["input_ids"]) >= 4 for r in rows)


def test_preference_rows_split_the_random_ids_into_prompt_chosen_and_rejected():
    from benchmarks import harness

    rows = bench_trl.preference_rows(4, ByteTokenizer(), seq_len=10)
    assert rows == bench_trl.preference_rows(4, ByteTokenizer(), seq_len=10)
    source = harness.synthetic_dataset(4, 128, 10)
    for row, ids in zip(rows, source):
        assert row["prompt"] + row["chosen"] == "".join(chr(i) for i in ids["input_ids"])
        assert row["rejected"] == "".join(chr(i) for i in ids["labels"][5:])
        assert len(row["prompt"]) == len(row["chosen"]) == len(row["rejected"]) == 5
        assert row["chosen"] != row["rejected"]


def test_same_engine_config_compares_every_segment():
    same = [{"engine_config": {"zero_optimization": {"stage": 2}}}] * 3
    assert bench_trl.same_engine_config(same)
    assert not bench_trl.same_engine_config(same + [{"engine_config": {"zero_optimization": {"stage": 3}}}])


def _tiny_llama(path, seed):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def test_compare_saved_loads_and_compares_every_tensor(tmp_path):
    source = _tiny_llama(tmp_path / "source", seed=0)
    same = _tiny_llama(tmp_path / "same", seed=0)
    other = _tiny_llama(tmp_path / "other", seed=1)
    result = bench_trl.compare_saved(source, same, source)
    assert result["saved_equal"] and result["equal_to_source"] == [True, True] and result["tensors"] > 0
    result = bench_trl.compare_saved(same, other, source)
    assert not result["saved_equal"] and result["equal_to_source"] == [True, False]


@pytest.mark.parametrize("trainer", ["sft", "dpo"])
def test_both_paths_get_the_same_settings_and_one_resolved_config(tmp_path, trainer):
    import json

    model = _tiny_llama(tmp_path / "model", seed=0)
    opts = types.SimpleNamespace(batch=2, steps=5, seq_len=16)
    out = bench_trl.resolved_config(
        trainer, "zero3", model, opts, tmp_path / "ds.json",
        **{"zero_optimization.stage3_gather_16bit_weights_on_model_save": True},
    )  # fmt: skip
    config = json.loads(out.read_text())
    assert "auto" not in json.dumps(config)
    assert config["train_micro_batch_size_per_gpu"] == 2 and config["train_batch_size"] == 2 * 2
    assert config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    built = {
        path: bench_trl.trl_arguments(trainer, path, str(tmp_path / path), opts, None, prepare=False)
        for path in ("stock", "hf-ext")
    }
    names = ("bf16", "activation_checkpointing", "learning_rate", "max_length", "max_steps", "seed", "optim")
    stock, ours = ({n: getattr(args, n) for n in names} for args, _, _ in built.values())
    assert stock == ours and stock["bf16"] is False
    assert built["stock"][1].__module__.startswith("trl") and built["hf-ext"][1].__module__ == "hf_ext.trl"
    assert issubclass(built["hf-ext"][1], built["stock"][1])


def test_summary_groups_by_trainer():
    def row(trainer, path, samples_per_s, segment):
        return {"trainer": trainer, "size": "m", "config": "zero2", "path": path, "segment": segment,
                "parameters": 10, "global_batch": 8, "samples_per_s": samples_per_s, "args_s": 0.1,
                "engine_start_s": 1.0, "system_s_per_step": 0.0, "page_faults_per_step": 0.0,
                "user_s_per_step": 0.2, "torch_threads": 1}  # fmt: skip

    rows = [row("sft", "stock", 10.0, 0), row("sft", "hf-ext", 9.0, 1), row("dpo", "stock", 4.0, 0)]
    rows += [row("dpo", "hf-ext", 5.0, 1)]
    summary = bench_train.summarize(rows, keys=("trainer", "size", "config"))
    assert [(s["trainer"], s["ratio"]) for s in summary] == [("sft", pytest.approx(0.9)), ("dpo", pytest.approx(1.25))]
    assert summary[0]["pairs_of"] == "segments"


def test_pool_keeps_each_runs_pairs_and_pools_their_ratios():
    def run(stock, ours, same=True):
        rows = []
        for segment, (path, samples_per_s) in enumerate(zip(["stock", "hf-ext", "hf-ext", "stock"],
                                                            [stock[0], ours[0], ours[1], stock[1]])):  # fmt: skip
            rows.append({"trainer": "dpo", "size": "m", "config": "zero2", "path": path, "segment": segment,
                         "parameters": 10, "global_batch": 8, "samples_per_s": samples_per_s, "args_s": 0.1,
                         "engine_start_s": 1.0, "user_s_per_step": 0.2, "system_s_per_step": 0.0,
                         "page_faults_per_step": 0.0, "torch_threads": 1})  # fmt: skip
        return {"rows": rows, "launches": {"dpo": {"same_engine_config": same}}}

    summary, launches = bench_trl.pool([run((10.0, 10.0), (9.0, 11.0)), run((4.0, 5.0), (5.0, 4.0), same=False)])
    (entry,) = summary
    # pairs in segment order within each run: 9/10, 11/10, then 5/4, 4/5
    assert entry["per_launch_ratios"] == pytest.approx([0.9, 1.1, 1.25, 0.8])
    assert launches == {"dpo": {"same_engine_config": False}}
