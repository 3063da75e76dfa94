"""The BLEU eval on TRL's SFTTrainer (hf_ext.trl): prompt-completion rows, a decoder-only chat model, one process.

Oracle: stock ``generate`` on each prompt rendered by the tokenizer's own chat template with its generation prompt,
the reply decoded after the prompt, and sacreBLEU / chrF of those replies against the completions' text as written.
"""

from __future__ import annotations

import pytest
import sacrebleu
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_ext.trl

pytestmark = pytest.mark.slow

TOPICS = ["tea", "rain", "chess", "maps", "jazz", "bread"]


def test_sft_evaluation_logs_the_bleu_of_the_completions(tiny_chat_model_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_chat_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_chat_model_dir)
    rows = [{"prompt": [{"role": "user", "content": f"Do you like {t}?"}],
             "completion": [{"role": "assistant", "content": f"Yes, {t} is nice."}]} for t in TOPICS]  # fmt: skip
    args = hf_ext.trl.SFTConfig(output_dir=str(tmp_path), report_to=[], bf16=False, per_device_eval_batch_size=4,
                                generation_batch_size=4, use_cpu=True, max_steps=40, learning_rate=5e-3,
                                per_device_train_batch_size=6, activation_checkpointing=False)  # fmt: skip
    trainer = hf_ext.trl.SFTTrainer(model, args=args, train_dataset=Dataset.from_list(rows),
                                    eval_dataset=Dataset.from_list(rows), processing_class=tokenizer)  # fmt: skip
    trainer.train()  # a few dozen steps: the replies come to share words with the completions
    metrics = trainer.evaluate()

    hyps = []
    for row in rows:
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, return_tensors="pt",
                                               return_dict=True)  # fmt: skip
        with torch.no_grad():
            out = model.generate(**prompt)
        hyps.append(tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True).strip())
    refs = [row["completion"][0]["content"] for row in rows]
    shown = trainer.bleu_eval_callback.last_evaluation.rows
    assert [r["generation"] for r in shown] == hyps
    assert [r["reference"] for r in shown] == refs
    assert metrics["eval_bleu"] == pytest.approx(sacrebleu.corpus_bleu(hyps, [refs]).score, abs=1e-9)
    assert metrics["eval_chrf"] == pytest.approx(sacrebleu.corpus_chrf(hyps, [refs]).score, abs=1e-9)
    assert metrics["eval_bleu"] > 0 and "eval_loss" in metrics  # TRL's own eval ran beside it
