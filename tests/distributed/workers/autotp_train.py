"""Train a tiny Llama for a few steps with ``hf_ext.Trainer``, under DeepSpeed AutoTP, under DeepSpeed's Ulysses
sequence parallelism or on one plain rank.

    torchrun --nproc_per_node 2 tests/distributed/workers/autotp_train.py --model DIR --out FILE --autotp 2
    torchrun --nproc_per_node 2 tests/distributed/workers/autotp_train.py --model DIR --out FILE --ulysses 2
    python tests/distributed/workers/autotp_train.py --model DIR --out FILE

The same 32 seeded rows, micro-batch 2, accumulation 2, 6 steps, torch's AdamW (the Trainer's, not DeepSpeed's),
dropout off. Writes ``FILE`` (JSON, rank 0): the per-step losses and grad norms, the ``train_batch_size`` DeepSpeed was
started with, the rows per optimizer step the Trainer counts, the tokens it counts, the world size and, per step, the
rows each rank trained.
With ``--resume``: the run saves checkpoint-3 too, and a second trainer resumes it to step 6; ``FILE`` adds what
hf-ext planned for that resume, the batch it ran, and its losses of steps 4-6. ``--checkpoint``: checkpoint-3
saved, no resume.

    python tests/launched/ranks.py --nproc 1 tests/distributed/workers/autotp_train.py --model DIR --out FILE \
        --resume_from CHECKPOINT [CHECKPOINT ...]

resumes each checkpoint (of another layout) to step 6 on this run's ranks, under ZeRO-1 without tensor or sequence
parallelism, one trainer after the other; ``FILE`` holds, for each, hf-ext's plan, the accumulation it ran and the
per-step losses and grad norms (steps 1-3 from the checkpoint's history).
"""

from __future__ import annotations

import argparse
import json

import torch
from datasets import Dataset
from transformers import AutoConfig, AutoModelForCausalLM, TrainerCallback

import hf_ext


class RowsSeen(TrainerCallback):
    """The ``row`` ids of every micro-batch this rank trained, by optimizer step."""

    def __init__(self):
        self.rows, self.current = {}, []

    def on_step_end(self, args, state, control, **kwargs):
        self.rows[state.global_step], self.current = self.current, []


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--autotp", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--checkpoint", action="store_true", help="save checkpoint-3 (implied by --resume)")
    parser.add_argument("--ulysses", type=int, default=0, help="DeepSpeed Ulysses sequence parallelism of this size")
    parser.add_argument("--optim", default="adamw_torch")
    parser.add_argument("--max_grad_norm", type=float, default=1.0)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--resume_from", nargs="+", default=[], help="checkpoints of other layouts (see above)")
    opts = parser.parse_args()

    def arguments() -> hf_ext.TrainingArguments:
        deepspeed, layout = None, {}
        if opts.autotp or opts.ulysses or opts.resume_from:  # ZeRO-1 with every batch key filled by hf-ext
            deepspeed = {"zero_optimization": {"stage": 1}, "train_batch_size": "auto",
                         "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                         "gradient_clipping": "auto"}  # fmt: skip
        if opts.autotp:
            deepspeed["tensor_parallel"] = {"autotp_size": opts.autotp}
        if opts.ulysses:  # accelerate's ParallelismConfig: DeepSpeed's ALST, SDPA inside each rank's attention
            from accelerate.parallelism_config import ParallelismConfig
            from accelerate.utils import DeepSpeedSequenceParallelConfig

            handler = DeepSpeedSequenceParallelConfig(sp_seq_length_is_variable=True, sp_attn_implementation="sdpa")
            layout["parallelism_config"] = ParallelismConfig(sp_size=opts.ulysses, sp_backend="deepspeed",
                                                             sp_handler=handler)  # fmt: skip
        saves = opts.resume or opts.checkpoint
        saving = {"save_strategy": "steps", "save_steps": 3} if saves else {"save_strategy": "no"}
        return hf_ext.TrainingArguments(output_dir=opts.out + ".run", per_device_train_batch_size=2,
                                        gradient_accumulation_steps=2, max_steps=6, learning_rate=opts.learning_rate,
                                        optim=opts.optim, max_grad_norm=opts.max_grad_norm,
                                        logging_steps=1, report_to=[], deepspeed=deepspeed, seed=0,
                                        remove_unused_columns=False, include_num_input_tokens_seen="all",
                                        **saving, **layout)  # fmt: skip

    def model():
        return AutoModelForCausalLM.from_pretrained(opts.model, attention_dropout=0.0, attn_implementation="sdpa")

    args = arguments()
    vocab = AutoConfig.from_pretrained(opts.model).vocab_size
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(32):
        ids = torch.randint(5, vocab, (12,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": ids, "row": i})
    seen = RowsSeen()

    def collate(batch):
        seen.current += [r["row"] for r in batch]
        tensors = {k: torch.tensor([r[k] for r in batch]) for k in ("input_ids", "labels")}
        if opts.ulysses:  # each token's position in its row, which a rank holding a slice of the row cannot infer
            tensors["position_ids"] = torch.arange(tensors["input_ids"].shape[1]).expand_as(tensors["input_ids"])
        return tensors

    if opts.resume_from:
        resumes = []
        for checkpoint in opts.resume_from:
            trainer = hf_ext.Trainer(model=model(), args=arguments(), train_dataset=Dataset.from_list(rows),
                                     data_collator=collate)  # fmt: skip
            trainer.train(resume_from_checkpoint=checkpoint)
            history = [r for r in trainer.state.log_history if "loss" in r]
            resumes.append({"kind": trainer.resume_plan.kind, "accumulation": trainer.args.gradient_accumulation_steps,
                            "losses": [r["loss"] for r in history], "grad_norms": [r["grad_norm"] for r in history]})  # fmt: skip
        if args.process_index == 0:
            with open(opts.out, "w") as f:
                json.dump({"world_size": args.world_size, "resumes": resumes}, f)
        return
    trainer = hf_ext.Trainer(model=model(), args=args, train_dataset=Dataset.from_list(rows), data_collator=collate,
                             callbacks=[seen])  # fmt: skip
    trainer.train()
    resumed = None
    if opts.resume:
        resumed = hf_ext.Trainer(model=model(), args=arguments(), train_dataset=Dataset.from_list(rows),
                                 data_collator=collate)  # fmt: skip
        resumed.train(resume_from_checkpoint=f"{args.output_dir}/checkpoint-3")
    gathered = [None] * args.world_size
    if args.world_size > 1:
        torch.distributed.all_gather_object(gathered, seen.rows)
    else:
        gathered = [seen.rows]
    if args.process_index == 0:
        history = [r for r in trainer.state.log_history if "loss" in r]
        result = {
            "world_size": args.world_size,
            "losses": [r["loss"] for r in history],
            "grad_norms": [r["grad_norm"] for r in history],
            "deepspeed_train_batch_size": args.hf_deepspeed_config.config["train_batch_size"]
            if args.deepspeed
            else None,
            "rows_per_step": trainer.get_total_train_batch_size(args),
            "tokens_seen": trainer.state.num_input_tokens_seen,
            "rows": gathered,
        }
        if resumed is not None:
            result["resume_kind"] = resumed.resume_plan.kind
            result["resumed_accumulation"] = resumed.args.gradient_accumulation_steps
            result["resumed_losses"] = [r["loss"] for r in resumed.state.log_history if "loss" in r and r["step"] > 3]
        with open(opts.out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
    hf_ext.end_distributed()
