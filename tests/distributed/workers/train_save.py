"""Train a tiny model (BlenderBot, or a decoder-only chat model) on synthetic token data with hf-ext's Seq2SeqTrainer
and leave artifacts to check.

    deepspeed --num_gpus 2 tests/distributed/workers/train_save.py --model DIR --out DIR --stage 3 [--gather on|off|misnamed]
        [--resume true|PATH] [--dump FILE] [--stock_save DIR] [--max_shard_size 20KB] [--accum N] [--samples FILE]
        [--eval_first] [--bf16]

With --lora, LoRA (r=4) on --lora_targets (default q_proj,v_proj; "all-linear" for every projection) (+
--modules_to_save NAME); dropout is off so that runs on different
world sizes compare within float tolerance. --no_ds runs without DeepSpeed (launch it with plain python).

HF_EXT_TEST_KILL_AT_STEP=N makes rank 1 SIGKILL itself while the checkpoint of step N is being written (after the
model and the optimizer state went into the temporary directory, before the RNG and trainer state).

--kill_final_save_at PATTERN makes rank 0 SIGKILL itself at the first write event of the final save whose name
matches the regular expression PATTERN (a shard opened, a tensor written, the index, the model files, the fsync, the
swap: see ``SaveEvents``); the trained weights are dumped (--dump) before that save. --list_save_events FILE writes the
events of an uninterrupted final save there, and into FILE.listings.json every distinct listing of ``--out`` (its
entries but the hidden staging ones) a reader saw during that save: at each event, and from a thread polling it.
--raise_on_rank1 {checkpoint,final_save,resume,evaluation} makes rank 1 alone raise inside that step.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed.fsdp
import torch.distributed.tensor
import transformers
from transformers import AutoConfig, AutoTokenizer, DataCollatorWithFlattening, default_data_collator

import hf_ext
from hf_ext.deepspeed.resolve import load_deepspeed_config
from hf_ext.model_info import model_class
from hf_ext.runtime import run_summary
from tests.saving_support import gathered_state_dict

GATHER_KEY = "stage3_gather_16bit_weights_on_model_save"


#: a config that writes DeepSpeed's own schedule (the presets leave it to the Trainer): make demo's
DEEPSPEED_SCHEDULE = json.loads((Path(__file__).resolve().parents[3] / "recipes" / "configs" /
                                 "ds_zero2_warmup_decay.json").read_text())["scheduler"]  # fmt: skip


def ds_config(stage: int, gather: str, own_scheduler: bool = True) -> dict:
    config = load_deepspeed_config(f"zero{stage}")
    if own_scheduler:  # DeepSpeed's schedule kept in its engine; else transformers', as in a run without DeepSpeed
        config["scheduler"] = DEEPSPEED_SCHEDULE
    zero = config["zero_optimization"]
    zero.pop(GATHER_KEY, None)
    if stage == 3:
        if gather == "on":
            zero[GATHER_KEY] = True
        elif gather == "off":
            zero[GATHER_KEY] = False
        elif gather == "misnamed":
            zero["gather_16bit_weights_on_model_save"] = True  # DeepSpeed's own spelling; transformers misses it
    return config


def synthetic_dataset(n: int, vocab: int, seed: int = 0, causal: bool = False, varied: bool = False) -> list[dict]:
    """12 context tokens -> 8 reply tokens + eos (id 2); ``varied``: 3-24 context and 1-12 reply tokens. A
    decoder-only row is the context followed by the reply, with the loss on the reply only."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        n_context, n_reply = (
            (int(torch.randint(3, 25, (), generator=g)), int(torch.randint(1, 13, (), generator=g)))
            if varied
            else (12, 8)
        )
        context = torch.randint(4, vocab, (n_context,), generator=g).tolist()
        reply = torch.randint(4, vocab, (n_reply,), generator=g).tolist() + [2]
        if causal:
            ids = context + reply
            rows.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": [-100] * n_context + reply})
        else:
            rows.append({"input_ids": context, "attention_mask": [1] * 12, "labels": reply})
    return rows


class FlatteningWithSampleIds(DataCollatorWithFlattening):
    """Flattens the rows as hf-ext's padding-free collator does, and carries their sample ids beside them."""

    def __call__(self, features, *args, **kwargs):
        batch = super().__call__([{k: v for k, v in f.items() if k != "sample_id"} for f in features], *args, **kwargs)
        batch["sample_id"] = torch.tensor([f["sample_id"] for f in features])
        return batch


class SampleRecordingTrainer(hf_ext.Seq2SeqTrainer):
    """Records ``[optimizer step, sample id]`` for every sample a training forward sees (the rows carry their index,
    taken out of the batch before the model sees it)."""

    samples: list[list[int]]

    def compute_loss(self, model, inputs, *args, **kwargs):
        ids = inputs.pop("sample_id")
        if model.training:
            self.samples = getattr(self, "samples", [])
            self.samples += [[self.state.global_step + 1, int(i)] for i in ids]
        return super().compute_loss(model, inputs, *args, **kwargs)


def stock_check(opts, model, data) -> None:
    """Stock transformers with the same ``fsdp`` value, on a copy of the model: which engine wraps it."""
    import copy

    args = transformers.Seq2SeqTrainingArguments(
        output_dir=opts.out + "-stock", fsdp=opts.fsdp, use_cpu=True, max_steps=1, report_to=[], save_strategy="no",
        per_device_train_batch_size=opts.batch, disable_tqdm=True,
    )  # fmt: skip
    stock = transformers.Seq2SeqTrainer(model=copy.deepcopy(model), args=args, train_dataset=data,
                                        data_collator=default_data_collator)  # fmt: skip
    stock.train()
    params = list(stock.model_wrapped.parameters())
    if args.process_index == 0:
        with open(opts.stock_fsdp_check, "w") as f:
            json.dump({"engine": type(stock.model_wrapped).__name__,
                       "dtensors": sum(isinstance(p, torch.distributed.tensor.DTensor) for p in params),
                       "distributed_type": str(stock.accelerator.distributed_type)}, f)  # fmt: skip


def listing(folder: str) -> tuple[str, ...] | None:
    """What a reader of ``folder`` sees: its entries but the hidden siblings' (None: no folder there)."""
    try:
        return tuple(sorted(name for name in os.listdir(folder) if not name.startswith(".")))
    except FileNotFoundError:
        return None


class SaveEvents:
    """Lists the final save's write events on this rank; SIGKILLs the process at the first whose name fullmatches the
    regular expression ``kill_at``. With ``watch``, a reader of that folder: its listing at every event, and a thread
    that lists it as fast as it can until :meth:`stop`."""

    def __init__(self, kill_at: str | None, watch: str | None = None):
        self.kill_at, self.names, self.watch, self.listings = kill_at, [], watch, set()
        self._polling = threading.Event()
        if watch:
            self._polling.set()
            self._poller = threading.Thread(target=self._poll, daemon=True)
            self._poller.start()

    def _poll(self) -> None:
        while self._polling.is_set():
            self.listings.add(listing(self.watch))

    def stop(self) -> list:
        self._polling.clear()
        if self.watch:
            self._poller.join()
        return sorted(self.listings, key=lambda names: (names is None, names or ()))

    def event(self, name: str) -> None:
        self.names.append(name)
        if self.watch:
            self.listings.add(listing(self.watch))
        if self.kill_at is not None and re.fullmatch(self.kill_at, name):
            print(f"rank 0: SIGKILL at save event {len(self.names)} ({name})", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def install(self) -> None:
        """Wrap the points between which a kill must leave the old or the new save (each wrapper counts first)."""
        import builtins
        import pathlib

        from hf_ext import atomic
        from hf_ext.saving import writer, zero

        def before(module, name, label):
            original = getattr(module, name)

            def wrapped(*args, **kwargs):
                self.event(label)
                result = original(*args, **kwargs)
                return result

            setattr(module, name, wrapped)

        def after(module, name, label):
            original = getattr(module, name)

            def wrapped(*args, **kwargs):
                result = original(*args, **kwargs)
                self.event(label)
                return result

            setattr(module, name, wrapped)

        writer.open = lambda path, *a, **k: (
            self.event(f"open {pathlib.Path(path).name}"),
            builtins.open(path, *a, **k),
        )[1]
        after(writer, "_write_tensor", "tensor written")
        write_text = pathlib.Path.write_text
        pathlib.Path.write_text = lambda p, *a, **k: (self.event(f"write {p.name}"), write_text(p, *a, **k))[1]
        before(zero, "save_model_files", "model files")
        before(atomic, "fsync_tree", "fsync")
        carry = atomic.carry
        atomic.carry = lambda entry, dest: (carry(entry, dest), self.event(f"carried {dest.name}"))[0]
        before(atomic, "_exchange", "swap")
        after(atomic, "_exchange", "swapped")
        before(atomic.shutil, "rmtree", "remove old")


def raise_on_rank1(trainer, where: str) -> None:
    """Rank 1 alone raises inside ``where`` (a checkpoint's RNG state, the final save's list of tensors,
    the resume's reading of the checkpoint, the generation eval's decoding)."""
    if trainer.args.process_index != 1:
        return
    import hf_ext.saving.resume
    import hf_ext.saving.zero

    def fail(*args, **kwargs):
        print(f"rank 1 raises at {time.time():.3f}", flush=True)
        raise OSError(28, f"No space left on device (rank 1, injected in {where})")

    if where == "checkpoint":
        trainer._save_rng_state = fail
    elif where == "final_save":
        hf_ext.saving.zero.model_entries = fail
    elif where == "resume":
        hf_ext.saving.resume.read_zero_checkpoint = fail
    elif where == "evaluation":
        trainer.processing_class.batch_decode = fail  # inside the generation eval, before its gather


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--stage", type=int, default=3)
    parser.add_argument("--gather", default="on", choices=["on", "off", "misnamed"])
    parser.add_argument("--resume", default=None)
    parser.add_argument("--dump", default=None)
    parser.add_argument("--stock_save", default=None)
    parser.add_argument("--max_shard_size", default="20KB")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--n", type=int, default=32)
    parser.add_argument("--save_steps", type=int, default=4)
    parser.add_argument("--save_total_limit", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2, help="per-device batch size")
    parser.add_argument("--accum", type=int, default=1, help="gradient accumulation steps")
    parser.add_argument("--no_dropout", action="store_true", help="so that runs on different world sizes compare")
    parser.add_argument("--samples", default=None, help="write the sample ids each rank trained on, per step, here")
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--modules_to_save", default=None)
    parser.add_argument("--lora_targets", default="q_proj,v_proj")
    parser.add_argument("--no_ds", action="store_true")
    parser.add_argument("--fsdp", default=None, help="an fsdp value (full_shard, hybrid_shard...): FSDP, no DeepSpeed")
    parser.add_argument("--fsdp_config", default=None, help="fsdp_config as JSON")
    parser.add_argument("--bf16", action="store_true", help="bf16 mixed precision")
    parser.add_argument(
        "--full_determinism", action="store_true", help="deterministic kernels (the GPU tier's resumes)"
    )
    parser.add_argument("--eval_first", action="store_true", help="evaluate (loss + BLEU) on the rows before training")
    parser.add_argument(
        "--padding_free", action="store_true",
        help="decoder-only: rows of varied lengths, padding_free with the batch_rebalance sampler",
    )  # fmt: skip
    parser.add_argument(
        "--stock_fsdp_check",
        default=None,
        help="first train 1 step with stock transformers and the same --fsdp; write its engine here",
    )
    parser.add_argument("--kill_final_save_at", default=None, metavar="PATTERN")
    parser.add_argument("--list_save_events", default=None)
    parser.add_argument("--raise_on_rank1", default=None, choices=["checkpoint", "final_save", "resume", "evaluation"])
    parser.add_argument("--local_rank", type=int, default=-1)
    opts = parser.parse_args()

    args = hf_ext.Seq2SeqTrainingArguments(
        output_dir=opts.out,
        per_device_train_batch_size=opts.batch,
        gradient_accumulation_steps=opts.accum,
        remove_unused_columns=not opts.samples,  # the sample ids reach compute_loss
        num_train_epochs=opts.epochs,
        learning_rate=1e-3,
        save_strategy="steps",
        save_steps=opts.save_steps,
        save_total_limit=opts.save_total_limit,
        logging_steps=1,
        report_to=[],
        seed=0,
        deepspeed=None if opts.no_ds or opts.fsdp else ds_config(opts.stage, opts.gather, own_scheduler=not opts.lora),
        fsdp=opts.fsdp,
        fsdp_config=json.loads(opts.fsdp_config) if opts.fsdp_config else None,
        optim="adamw_torch",
        disable_tqdm=True,
        save_max_shard_size=opts.max_shard_size,
        bf16=opts.bf16,
        full_determinism=opts.full_determinism,
        per_device_eval_batch_size=4,
        padding_free=opts.padding_free,
        train_sampling_strategy="batch_rebalance" if opts.padding_free else "random",
    )
    transformers.set_seed(0)
    config = AutoConfig.from_pretrained(opts.model)
    causal = not config.is_encoder_decoder
    no_dropout = dict(dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    no_dropout = no_dropout if (opts.lora or opts.no_dropout) and not causal else {}
    model = model_class(config).from_pretrained(opts.model, **no_dropout)
    if opts.lora:
        from peft import LoraConfig, get_peft_model

        modules_to_save = [opts.modules_to_save] if opts.modules_to_save else None
        targets = "all-linear" if opts.lora_targets == "all-linear" else opts.lora_targets.split(",")
        lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=targets, modules_to_save=modules_to_save)
        model = get_peft_model(model, lora)
    data = synthetic_dataset(opts.n, config.vocab_size, causal=causal, varied=opts.padding_free)
    collator = default_data_collator
    if opts.stock_fsdp_check:
        stock_check(opts, model, data)
    trainer_class = hf_ext.Seq2SeqTrainer
    if opts.samples:
        data = [dict(row, sample_id=i) for i, row in enumerate(data)]
        trainer_class = SampleRecordingTrainer
        collator = FlatteningWithSampleIds() if opts.padding_free else collator
    trainer = trainer_class(
        model=model,
        args=args,
        train_dataset=data,
        data_collator=collator,
        processing_class=AutoTokenizer.from_pretrained(opts.model),
    )

    kill_at = os.environ.get("HF_EXT_TEST_KILL_AT_STEP")
    if kill_at and args.process_index == 1:
        save_rng_state = trainer._save_rng_state

        def save_rng_state_or_die(output_dir):
            if trainer.state.global_step == int(kill_at):
                print(f"rank 1: SIGKILL while saving into {output_dir}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return save_rng_state(output_dir)

        trainer._save_rng_state = save_rng_state_or_die

    if opts.raise_on_rank1:
        raise_on_rank1(trainer, opts.raise_on_rank1)
        # registered before any hook of hf_ext's, so it runs after them (atexit runs last-in first-out)
        atexit.register(
            lambda: print(f"at exit: process group alive: {torch.distributed.is_initialized()}", flush=True)
        )
    first_eval = trainer.evaluate(data) if opts.eval_first else None
    resume = {"true": True, None: None}.get(opts.resume, opts.resume)
    trainer.train(resume_from_checkpoint=resume)
    events = None
    if opts.kill_final_save_at is not None or opts.list_save_events:
        state_dict = gathered_state_dict(trainer.model)
        if args.process_index == 0:
            torch.save(state_dict, opts.dump)
            events = SaveEvents(opts.kill_final_save_at, watch=opts.out if opts.list_save_events else None)
            events.install()
    trainer.save_model()
    if events is not None and opts.list_save_events:
        listings = events.stop()
        with open(opts.list_save_events, "w") as f:
            json.dump(events.names, f)
        with open(f"{opts.list_save_events}.listings.json", "w") as f:
            json.dump(listings, f)
    engine = trainer.model_wrapped
    state_dict = gathered_state_dict(trainer.model)
    if opts.stock_save:
        transformers.Seq2SeqTrainer.save_model(trainer, opts.stock_save)
    if opts.samples:
        with open(f"{opts.samples}.rank{args.process_index}.json", "w") as f:
            json.dump(trainer.samples, f)
    if opts.fsdp and opts.dump:  # what this rank holds of each parameter
        local = {n: p.to_local() if isinstance(p, torch.distributed.tensor.DTensor) else p
                 for n, p in trainer.model.named_parameters()}  # fmt: skip
        torch.save({n: t.detach().clone() for n, t in local.items()}, f"{opts.dump}.rank{args.process_index}.pt")
    if args.process_index == 0 and opts.dump:
        torch.save(state_dict, opts.dump)
        info = {
            "world_size": args.world_size,
            "gather_16bit": bool(getattr(engine, "zero_gather_16bit_weights_on_model_save", lambda: None)()),
            "global_step": trainer.state.global_step,
            "run": run_summary(trainer),
            "fsdp_units": [
                n for n, m in trainer.model.named_modules() if isinstance(m, torch.distributed.fsdp.FSDPModule)
            ],  # fmt: skip
            "log_history": trainer.state.log_history,
            "first_eval": first_eval,
        }
        with open(opts.dump + ".json", "w") as f:
            json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
    hf_ext.end_distributed()
