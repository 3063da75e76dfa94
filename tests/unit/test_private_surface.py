"""Every private part of transformers, accelerate, DeepSpeed, TRL, Gradio, torch and argparse that hf-ext (and
Chat-E) overrides, patches, calls, reads or mirrors, pinned to the version it was written against. When a pin fails after an upgrade, re-read the hf-ext
code named in the message against the new source, adapt it, then update the pin here and the version range in
pyproject.toml.

The pins are one table (:data:`PINS`: library, internal, how it is checked, the hf-ext code that depends on it), checked
by one parametrized test. A pin calls the internal and checks the shape of what it returns, or checks the attribute
on an object built here, where that is cheap; it compares source (a hash, or the lines hf-ext relies on) where hf-ext
copies or mirrors the code, or where the object only exists inside a running multi-rank engine.

What is touched, and why no public hook does it:

* ``Trainer._save_checkpoint`` (overridden by ``hf_ext.saving.checkpoints.save_checkpoint_atomically``, which calls
  ``_get_output_dir``, ``_save_optimizer_and_scheduler``, ``_save_scaler``, ``_save_rng_state``,
  ``_push_from_checkpoint`` and ``save_model(_internal_call=True)`` as stock does): stock writes into ``checkpoint-N``
  and rotates older checkpoints away on rank 0 before the other ranks finish writing; both happen before any public
  hook runs, so a crash there can lose the newest complete checkpoint.
* transformers' JIT checkpoint (``CheckpointManager._enable_checkpoint``, the timer its ``_sigterm_handler`` starts,
  and ``_original_sigterm_handler``, which ``JITCheckpointCallback.on_train_end`` restores; ``hf_ext.preemption``):
  with several ranks hf-ext turns the end of the kill wait into a request the ranks agree on, and only the manager's
  timer sees that moment.
* ``Trainer._load_optimizer_and_scheduler`` (overridden by ``hf_ext.trainer``): the stock loader reads per-rank
  optimizer files only; hf-ext's PEFT checkpoints hold the state by parameter name, for any world size.
* ``Trainer._get_train_sampler`` (extended by ``hf_ext.trainer``) and ``BatchRebalanceSampler``'s grouping
  (``hf_ext.packing``): stock builds the sampler with a fixed seed and a padded cost model, and no public hook sees it
  before the dataloader holds it; ``PackedRebalanceSampler`` replaces the grouping and the cost of a group.
* ``Trainer._track_num_input_tokens`` (extended by ``hf_ext.trainer``): stock adds every rank's tokens to
  ``num_input_tokens_seen``, twice under 2-way tensor parallelism, whose ranks share their micro-batches; it runs
  inside the training loop, before any hook sees the step's inputs.
* ``Trainer.create_accelerator_and_postprocess`` (extended by ``hf_ext.trainer``): the one place where the trainer's
  ``Accelerator`` exists and the model is not prepared yet; ``hf_ext.fsdp.engine.enable_on_trainer`` switches CPU
  ranks to FSDP2 there. No callback runs that early.
* ``transformers.trainer.deepspeed_load_checkpoint`` (patched while ``train`` resumes an hf-ext PEFT checkpoint under
  DeepSpeed, ``hf_ext.saving.resume.peft_state_under_deepspeed``): it raises on a directory without DeepSpeed's
  partitioned state, before ``_load_optimizer_and_scheduler`` loads the trainable state by name.
* ``DeepSpeedEngine._config.load_universal_checkpoint`` and the ``latest_universal`` tag file
  (``hf_ext.saving.resume.apply_resume_plan`` sets DeepSpeed's public ``checkpoint.load_universal`` key in the config
  the engine starts from when it resumes a universal conversion): pinned so that the key keeps meaning what
  ``load_checkpoint`` reads.
* DeepSpeed's checkpoint layout (``latest``, ``*mp_rank_00_model_states.pt`` holding ``ds_config`` and
  ``dp_world_size``, ``*zero_pp_rank_*_mp_rank_00_optim_states.pt``) and ``ds_to_universal``'s command line
  (``hf_ext.saving.resume``, ``hf_ext.saving.model_dir``): DeepSpeed has no API that says which world size wrote a
  checkpoint without starting an engine, and ``ds_to_universal`` is a script only.
* ``DeepSpeedEngine._configure_basic_optimizer`` (mirrored by ``hf_ext.deepspeed.schema.optimizer_parameters`` and
  ``_ADAM_POPPED``): the class the engine builds for an ``optimizer.type``, and the parameters it pops, decide which
  ``optimizer.params`` are valid; DeepSpeed only finds out when the engine starts.
* ``deepspeed.runtime.config._REMOVED_*_CONFIG_KEYS`` and the keys ``DeepSpeedConfig`` looks up while parsing
  (``hf_ext.deepspeed.schema``): DeepSpeed's own record of removed features and of its top-level keys; it publishes
  neither.
* ZeRO internals of parameters and optimizers (``hf_ext.peft``, ``hf_ext.gather``, ``hf_ext.saving.writer``,
  ``hf_ext.evaluation.gathered``): ``ds_id`` / ``ds_shape`` / ``ds_numel`` of ZeRO-3 parameters and ``_hp_mapping``
  of ZeRO-1/2 ones (the attributes DeepSpeed's own ``safe_get_full_*`` dispatch on), the flat fp32 partitions that
  key the optimizer state (``single_partition_of_fp32_groups``, ``fp32_partitioned_groups_flat``) and the wrapped
  ``optimizer``: a PEFT checkpoint holds the state by parameter name, which needs the state to exist before a step.
* DeepSpeed's CPU shared-memory workspace (``hf_ext.runtime``): ``deepspeed.comm.comm.cdb.shm_comm_op`` says it exists,
  its name is built in C++ (``shm.cpp``) and never unlinked; there is no call that releases it.
* DeepSpeed's LR schedulers' ``last_batch_iteration`` (``hf_ext.schedule``): the step they compute ``get_lr`` from.
* torch's ``LambdaLR`` state keys (``hf_ext.saving.convert``): a converted checkpoint keeps the schedule's position
  and leaves what depends on the optimizer's groups to the engine that loads it; torch documents no key.
* ``PreTrainedModel._tp_size`` (``hf_ext.batching.layout_of``): where stock's ``Trainer.get_tp_size`` reads the
  tensor-parallel size, read the same way.
* ``torch.ao.quantization.quantize_dynamic`` (``chat_e.engines.local.quantize_int8``, the CLI's int8 serving):
  deprecated in favour of torchao, which is not a dependency; its published speed and quality numbers are this path's.
* ``Accelerator._models`` (``hf_ext.evaluation.zero_eval``): the models accelerate prepared, restored after an
  engine-free evaluation on ZeRO-1/2; and (``hf_ext.fsdp.engine.shard_for_evaluation``) the FSDP2 model sharded
  before an evaluation (with accelerate's own ``fsdp2_prepare_model``, which ``prepare`` runs for a model and its
  optimizer together), recorded there so that stock ``evaluation_loop`` does not prepare it alone.
* ``AcceleratorState.distributed_type`` / ``PartialState._shared_state`` (``hf_ext.fsdp.engine``): set to FSDP on CPU
  ranks, where accelerate drops its FSDP plugin; accelerate writes the same shared-state key itself at the end of
  ``AcceleratorState.__init__``. ``ParallelismConfig._validate_accelerator``: the check accelerate runs on a device
  mesh, run again once the state is FSDP (hybrid sharding).
* ``HfTrainerDeepSpeedConfig.trainer_config_process`` / ``trainer_config_finalize`` (mirrored by
  ``hf_ext.deepspeed.resolve``) and ``DeepSpeedPlugin.__post_init__`` (mirrored by ``hf_ext.deepspeed.load`` for an
  accelerate YAML): hf-ext resolves a config before the Trainer exists, the way these fill it once it does, so that
  every mismatch is reported at once and nothing ``"auto"`` is left.
* TRL (``hf_ext/trl.py``): ``prepare_deepspeed`` deep-copies the trainer's DeepSpeed config for DPO's and KTO's
  reference model inside their ``__init__``, so hf-ext completes that config where the accelerator is created;
  ``_BaseConfig.__post_init__`` decides ``bf16`` after hf-ext has resolved the config, so hf-ext applies the same
  default first; each trainer's ``_save_checkpoint`` adds a model card before the stock one, which hf-ext replaces,
  so hf-ext writes the card itself.
* DeepSpeed ZeRO-1/2's ``_lazy_init_hp_params_optimizer_state`` (``hf_ext.peft``): the parameters' views of the
  optimizer state are linked at the first step only; a PEFT resume writes the state through them before one.
* ``DeepSpeedPlugin.hf_ds_config`` (``hf_ext.deepspeed.callbacks``, ``hf_ext.saving.resume``): the config dict the
  engine starts from, filled once the model exists; ``HfTrainerDeepSpeedConfig.mismatches`` (``hf_ext.training_args``):
  stock's list of config/argument conflicts, raised as hf-ext's error.
* The ``ACCELERATE_*`` variables ``accelerate launch`` hands a DeepSpeed run (``hf_ext.deepspeed.load``,
  ``hf_ext.training_args``): the only record of the YAML's DeepSpeed settings in the launched process.
* ``launch_command_parser()._actions`` (``hf_ext.fsdp.config``): accelerate's FSDP options, the keys of an accelerate
  config file it does not silently ignore; ``ArgumentParser._actions`` (``hf_ext.config_args``): argparse lists its
  options nowhere else, and the YAML keys are checked against them.
* transformers' ``PreTrainedModel._from_config``, ``_no_split_modules``, ``all_tied_weights_keys`` and
  ``Trainer.model_accepts_loss_kwargs``, ``TrainingArguments.fsdp_plugin_args`` (``hf_ext.model_info``,
  ``hf_ext.saving``, ``hf_ext.fsdp.engine``, ``hf_ext.trainer``): a random-init model with the config's dtype, the
  layer classes, the tied names a save may leave out, stock's loss scaling switch, the FSDP plugin arguments.
* torch's profiler ``kineto_results`` (``hf_ext.memory.probe``): the memory events of a profile, which the public
  ``events()`` folds into per-operator totals; ``Module._parameters`` / ``_buffers`` /
  ``_non_persistent_buffers_set`` (``hf_ext.evaluation.gathered``, ``hf_ext.saving.writer``): the one way to rebind a
  module's tensors in place, and to tell the buffers ``state_dict`` leaves out without building it.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import pytest


@dataclass(frozen=True)
class Pin:
    library: str
    internal: str  # as the failure message names it
    check: str  # how it is checked
    ours: str  # the hf-ext code to re-read when it fails
    verify: Callable[[], None]  # raises when the internal is not what hf-ext was written against


def resolve(target: str):
    """``"module:Qual.name"`` -> the object, looked up when the check runs (so that a patched one is seen)."""
    module, _, qualname = target.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split(".") if qualname else ():
        obj = getattr(obj, part)
    return obj


def source_of(target: str) -> str:
    return inspect.getsource(resolve(target))


def source_hash(target: str, digest: str) -> Callable[[], None]:
    """sha256 of ``inspect.getsource``: hf-ext copies, overrides or mirrors this code."""

    def verify():
        found = hashlib.sha256(source_of(target).encode()).hexdigest()
        assert found == digest, f"source sha256 {found}, pinned {digest}"

    return verify


def signature(target: str, params: list[str]) -> Callable[[], None]:
    def verify():
        found = list(inspect.signature(resolve(target)).parameters)
        assert found == params, f"parameters {found}, pinned {params}"

    return verify


def source_has(target: str, *snippets: str) -> Callable[[], None]:
    """The lines hf-ext relies on are still in ``target``'s source."""

    def verify():
        source = source_of(target)
        missing = [s for s in snippets if s not in source]
        assert not missing, f"no longer in its source: {missing}"

    return verify


def all_of(*checks: Callable[[], None]) -> Callable[[], None]:
    def verify():
        for check in checks:
            check()

    return verify


def failure(pin: Pin) -> str | None:
    """``None`` when ``pin`` holds, else a message naming the internal and the hf-ext code to re-read."""
    try:
        pin.verify()
    except Exception as err:  # noqa: BLE001 - any change of the internal (gone, renamed, reshaped) is the finding
        return (f"{pin.library} changed {pin.internal} ({type(err).__name__}: {err}): re-read {pin.ours} against it, "
                "then update its pin in tests/unit/test_private_surface.py")  # fmt: skip
    return None


# --- behavioural checks: the internal is called, or looked up on a real object ------------------------------------


def deepspeed_load_runs_before_the_optimizer_loader():
    loop = source_of("transformers:Trainer._prepare_for_training")
    patched_call = loop.index("deepspeed_load_checkpoint(")
    assert patched_call < loop.index("self._load_optimizer_and_scheduler(resume_from_checkpoint)"), (
        "the DeepSpeed resume no longer runs before _load_optimizer_and_scheduler"
    )


def accelerate_gate_leaves_cpu_out():
    source = source_of("accelerate.state:AcceleratorState.__init__")
    gate = source[source.index("elif self.distributed_type in [") : source.index("DistributedType.FSDP\n")]
    assert "DistributedType.MULTI_GPU" in gate and "DistributedType.MULTI_CPU" not in gate, "the FSDP gate changed"
    assert 'PartialState._shared_state["distributed_type"] = self.distributed_type' in source


def engine_config_switches_load_universal():
    from deepspeed.runtime.config import DeepSpeedConfig

    config = DeepSpeedConfig({"train_batch_size": 1, "checkpoint": {"load_universal": True}})
    assert config.load_universal_checkpoint is True
    source_has("deepspeed.runtime.engine:DeepSpeedEngine.load_universal_checkpoint",
               "return self._config.load_universal_checkpoint")()  # fmt: skip
    source_has("deepspeed.runtime.engine:DeepSpeedEngine.load_checkpoint", "self.load_universal_checkpoint()",
               '"latest_universal" if self.load_universal_checkpoint() else "latest"')()  # fmt: skip


def checkpoint_file_names():
    """The names hf_ext.saving.resume globs for, from the engine's own naming methods (``self`` faked)."""
    from types import SimpleNamespace

    from deepspeed.runtime.engine import DeepSpeedEngine as E

    def fake(partitioned: bool):
        return SimpleNamespace(checkpoint_mp_rank=0, zero_optimization_partition_weights=lambda: partitioned,
                               _get_zero_ckpt_prefix=lambda dp, bf16_mode: E._get_zero_ckpt_prefix(None, dp, bf16_mode))  # fmt: skip

    names = {
        Path(E._get_ckpt_name(fake(False), "run", "global_step1")).name,  # ZeRO-1/2
        Path(E._get_ckpt_name(fake(True), "run", "global_step1", pp_placeholder=1)).name,  # ZeRO-3
    }
    for bf16 in (False, True):
        names.add(Path(E._get_rank_zero_ckpt_name(fake(True), "run", "global_step1", 0, 1, bf16)).name)
    assert names == {
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_1_mp_rank_00_model_states.pt",
        "zero_pp_rank_1_mp_rank_00_optim_states.pt",
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
    }, f"file names {sorted(names)}"
    source_has("deepspeed.runtime.engine:DeepSpeedEngine._common_checkpoint_state", "dp_world_size=", "ds_config=")()
    source_has("deepspeed.runtime.engine:DeepSpeedEngine.save_checkpoint", "os.path.join(save_dir, 'latest')")()


def ds_to_universal_flags():
    from deepspeed.checkpoint import ds_to_universal

    argv = ["ds_to_universal", "--input_folder", "in", "--output_folder", "out", "--inject_missing_state",
            "--num_extract_workers", "2", "--num_merge_workers", "3"]  # fmt: skip
    with mock.patch.object(sys, "argv", argv):
        args = ds_to_universal.parse_arguments()
    got = (args.input_folder, args.output_folder, args.inject_missing_state, args.num_extract_workers,
           args.num_merge_workers)  # fmt: skip
    assert got == ("in", "out", True, 2, 3), f"parsed {got}"


def removed_key_tables():
    from deepspeed.runtime import config as ds_config

    for table in (ds_config._REMOVED_TOP_LEVEL_CONFIG_KEYS, ds_config._REMOVED_ZERO_CONFIG_KEYS):
        assert isinstance(table, dict) and table, f"{type(table).__name__} {table!r:.80}"
        assert all(isinstance(k, str) and isinstance(m, str) for k, m in table.items()), "not {key: message}"


def config_parse_looks_keys_up():
    """hf_ext.deepspeed.schema learns the known top-level keys by recording what DeepSpeedConfig looks up."""
    from hf_ext.deepspeed import schema

    found = schema.known_top_level_keys.__wrapped__() - set(schema._SECTIONS_READ_ELSEWHERE)
    expected = {"train_batch_size", "gradient_clipping", "bf16", "fp16", "checkpoint", "steps_per_print"}
    assert expected <= found, f"no longer looked up: {sorted(expected - found)}"


def hp_mapping_of_zero12_params():
    import torch
    from deepspeed.utils.mixed_precision_linkage import link_hp_params

    lp = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    flat = torch.zeros(4)
    link_hp_params([lp], flat, {0: [torch.zeros(4)]}, {}, False, 0, 0, 4, None)
    assert lp._hp_mapping is not None, "link_hp_params set no _hp_mapping"
    source_has("deepspeed.utils.tensor_fragment:safe_get_full_fp32_param",
               "if hasattr(param, 'ds_id'):", "if hasattr(param, '_hp_mapping'):")()  # fmt: skip
    source_has("deepspeed.utils.tensor_fragment:safe_get_full_optimizer_state",
               "if hasattr(param, 'ds_id'):", "if hasattr(param, '_hp_mapping'):")()  # fmt: skip


def profiler_memory_events():
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        x = torch.empty(1024, dtype=torch.uint8)
        del x
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    assert events, "no [memory] events in kineto_results"
    assert any(e.nbytes() == 1024 and e.device_type().name == "CPU" for e in events), "no 1024-byte CPU allocation"
    assert all(isinstance(e.start_ns(), int) for e in events)


def lambda_lr_state_keys():
    """The keys of a ``LambdaLR`` state that ``hf-ext convert`` keeps (its position), and those it leaves to the
    optimizer that loads it."""
    import torch

    from hf_ext.saving.convert import _schedule_position

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (step + 1))
    optimizer.step()
    scheduler.step()
    state = scheduler.state_dict()
    kept = _schedule_position(state)
    assert set(state) == {*kept, "base_lrs"}, f"LambdaLR state keys {sorted(state)}"
    assert kept["last_epoch"] == 1 and kept["_step_count"] == 2, kept


def dynamic_int8_linear():
    """``torch.ao.quantization.quantize_dynamic`` (deprecated in favour of torchao, still shipped): int8 weights for
    the named ``nn.Linear`` layers only, quantized activations on the fly."""
    import warnings

    import torch

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantized = torch.ao.quantization.quantize_dynamic(model, {"0"}, dtype=torch.qint8)
    assert isinstance(quantized[0], torch.ao.nn.quantized.dynamic.Linear), type(quantized[0])
    assert type(quantized[1]) is torch.nn.Linear


def module_tensor_dicts():
    import torch

    module = torch.nn.Linear(2, 2)
    module.register_buffer("kept", torch.zeros(1))
    module.register_buffer("dropped", torch.zeros(1), persistent=False)
    assert set(module._parameters) == {"weight", "bias"} and set(module._buffers) == {"kept", "dropped"}
    assert module._non_persistent_buffers_set == {"dropped"}
    module._parameters["bias"] = torch.nn.Parameter(torch.ones(2))  # rebinding in place is what gathered_copy does
    assert module.bias.sum().item() == 2


def tiny_llama(**config):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM._from_config(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=8,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2, **config))  # fmt: skip


def from_config_and_tied_keys():
    model = tiny_llama(tie_word_embeddings=True)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert "lm_head.weight" in set(model.all_tied_weights_keys), f"all_tied_weights_keys {model.all_tied_weights_keys}"
    assert set(model._no_split_modules) == {"LlamaDecoderLayer"}, f"_no_split_modules {model._no_split_modules}"
    from transformers import PreTrainedModel

    assert hasattr(PreTrainedModel, "_no_split_modules")


def accelerate_fsdp_options():
    from accelerate.commands.launch import launch_command_parser

    dests = {action.dest for action in launch_command_parser()._actions}
    fsdp = {d for d in dests if d.startswith("fsdp_")}
    assert {"fsdp_version", "fsdp_sharding_strategy", "fsdp_offload_params", "fsdp_state_dict_type"} <= fsdp, (
        f"fsdp options {sorted(fsdp)}"
    )


def argparse_actions():
    from transformers import HfArgumentParser, TrainingArguments

    parser = HfArgumentParser(TrainingArguments)
    action = next(a for a in parser._actions if a.dest == "per_device_train_batch_size")
    assert action.type is int and isinstance(action.help, (str, type(None)))


def accelerate_launch_variables():
    """Each variable hf-ext reads is one ``accelerate launch`` sets or accelerate's own DeepSpeed plugin reads."""
    from hf_ext.deepspeed.load import _ACCELERATE_ENV

    wanted = {"ACCELERATE_USE_DEEPSPEED", "ACCELERATE_DEEPSPEED_CONFIG_FILE", "ACCELERATE_CONFIG_DS_FIELDS",
              "ACCELERATE_MIXED_PRECISION", *_ACCELERATE_ENV.values()}  # fmt: skip
    sources = source_of("accelerate.utils.launch:prepare_deepspeed_cmd_env") + source_of(
        "accelerate.utils:DeepSpeedPlugin.__post_init__"
    )
    missing = sorted(name for name in wanted if f'"{name}"' not in sources)
    assert not missing, f"neither set by accelerate launch nor read by DeepSpeedPlugin: {missing}"


def deepspeed_scheduler_step():
    import torch
    from deepspeed.runtime.lr_schedules import WarmupLR

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = WarmupLR(optimizer, warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=10)
    scheduler.step()
    assert isinstance(scheduler.last_batch_iteration, int), "no last_batch_iteration"
    lrs = scheduler.get_lr()
    assert isinstance(lrs, list) and all(isinstance(lr, float) for lr in lrs), f"get_lr() {lrs!r}"


def shm_comm_op_and_name():
    from deepspeed.comm import comm as ds_comm

    assert hasattr(ds_comm, "cdb"), "deepspeed.comm.comm has no cdb"
    source_has("deepspeed.comm.torch:TorchBackend.__init__", "self.shm_comm_op = build_shm_op()")()
    csrc = Path(resolve("deepspeed").__file__).parent / "ops" / "csrc" / "cpu" / "comm"
    shm, interface = (csrc / "shm.cpp").read_text(), (csrc / "shm_interface.cpp").read_text()
    for line in ('#define SHM_BUFFER_NAME "deepspeed_allreduce_buffer"', '"%s_%d_%s_%s",', "SHM_BUFFER_NAME,",
                 "getuid(),", "addr_string,", "port_string);", 'snprintf(shm_name, NAME_BUF_SIZE, "%s_%d", shm_name_prefix, rank);'):  # fmt: skip
        assert line in shm, f"shm.cpp no longer has {line!r}"
    assert 'std::getenv("MASTER_ADDR")' in interface and 'std::getenv("MASTER_PORT")' in interface


# --- the table --------------------------------------------------------------------------------------------------

T = "transformers:Trainer"
ENGINE = "deepspeed.runtime.engine:DeepSpeedEngine"
CHECKPOINTS = "hf_ext/saving/checkpoints.py save_checkpoint_atomically"

PINS = [
    # transformers
    Pin("transformers", "Trainer._save_checkpoint", "source sha256", CHECKPOINTS,
        source_hash(f"{T}._save_checkpoint", "a9111e30faa9933986e022e56b5af81fd990356db64d727b4c320c852283bf3b")),
    Pin("transformers", "Trainer._load_optimizer_and_scheduler", "source sha256", "hf_ext/trainer.py",
        source_hash(f"{T}._load_optimizer_and_scheduler",
                    "741032f57d6fb80211506bf521f67bdd0ff876ad39cc50e700c9c2bab2efb251")),
    Pin("transformers", "Trainer.create_accelerator_and_postprocess", "source sha256",
        "hf_ext/trainer.py and hf_ext/fsdp/engine.py enable_on_trainer",
        source_hash(f"{T}.create_accelerator_and_postprocess",
                    "d649720bec7e782ad57f9126c98eb5cd3bc0ee59118f5445655f1a5744e436bc")),
    Pin("transformers", "Trainer._get_train_sampler", "source sha256", "hf_ext/trainer.py, hf_ext/packing.py run_sampler",
        source_hash(f"{T}._get_train_sampler", "1580d7493244e637dc53324da1ee594fdc5645b06972bb8cbc49ea08141dc88d")),
    Pin("transformers", "BatchRebalanceSampler._assign / _balance_groups / _group_cost and its attributes",
        "source lines", "hf_ext/packing.py PackedRebalanceSampler, run_sampler",
        all_of(source_has("transformers.trainer_pt_utils:BatchRebalanceSampler._assign",
                          "all_groups = self._balance_groups(sorted_pairs)", "self._group_cost(g)"),
               source_has("transformers.trainer_pt_utils:BatchRebalanceSampler.__init__",
                          "self.lengths = list(lengths)", "self.effective_batch_size = effective_batch_size",
                          "self.dp_size = dp_size", "self.grad_accum = grad_accum", "self.shuffle = shuffle",
                          "self.rank = rank", "self.drop_last = drop_last"))),
    Pin("transformers", "Trainer._get_output_dir", "signature", CHECKPOINTS,
        signature(f"{T}._get_output_dir", ["self", "trial"])),
    Pin("transformers", "Trainer._save_optimizer_and_scheduler", "signature", CHECKPOINTS,
        signature(f"{T}._save_optimizer_and_scheduler", ["self", "output_dir"])),
    Pin("transformers", "Trainer._save_scaler", "signature", CHECKPOINTS, signature(f"{T}._save_scaler", ["self", "output_dir"])),
    Pin("transformers", "Trainer._save_rng_state", "signature", CHECKPOINTS,
        signature(f"{T}._save_rng_state", ["self", "output_dir"])),
    Pin("transformers", "Trainer._push_from_checkpoint", "signature", CHECKPOINTS,
        signature(f"{T}._push_from_checkpoint", ["self", "checkpoint_folder"])),
    Pin("transformers", "CheckpointManager._enable_checkpoint / _sigterm_handler / _original_sigterm_handler",
        "source lines", "hf_ext/preemption.py AgreedCheckpointManager, combine_jit_checkpoint",
        all_of(source_has("transformers.trainer_jit_checkpoint:CheckpointManager._sigterm_handler",
                          "threading.Timer(self.kill_wait, self._enable_checkpoint).start()"),
               source_has("transformers.trainer_jit_checkpoint:CheckpointManager.setup_signal_handler",
                          "self._original_sigterm_handler = signal.signal(signal.SIGTERM, self._sigterm_handler)"),
               source_has("transformers.trainer_jit_checkpoint:JITCheckpointCallback.on_train_end",
                          "signal.signal(signal.SIGTERM, self.jit_manager._original_sigterm_handler)"))),
    Pin("transformers", "Trainer.store_flos", "signature", CHECKPOINTS, signature(f"{T}.store_flos", ["self"])),
    Pin("transformers", "Trainer.save_model(_internal_call)", "signature", f"hf_ext/trainer.py save_model, {CHECKPOINTS}",
        signature(f"{T}.save_model", ["self", "output_dir", "_internal_call"])),
    Pin("transformers", "transformers.trainer.deepspeed_load_checkpoint", "signature; called before "
        "_load_optimizer_and_scheduler in Trainer._prepare_for_training", "hf_ext/saving/resume.py peft_state_under_deepspeed",
        all_of(signature("transformers.trainer:deepspeed_load_checkpoint",
                         ["deepspeed_engine", "checkpoint_path", "load_module_strict"]),
               deepspeed_load_runs_before_the_optimizer_loader)),
    Pin("transformers", "Trainer._track_num_input_tokens", "signature; source lines", "hf_ext/trainer.py",
        all_of(signature(f"{T}._track_num_input_tokens", ["self", "inputs"]),
               source_has(f"{T}._track_num_input_tokens",
                          "self.state.num_input_tokens_seen += self.accelerator.gather(input_tokens).sum().item()"))),
    Pin("transformers", "Trainer.evaluation_loop reads Accelerator._models", "source lines",
        "hf_ext/fsdp/engine.py shard_for_evaluation",
        source_has(f"{T}.evaluation_loop", "len(self.accelerator._models) == 0")),
    Pin("transformers", "PreTrainedModel._from_config / _no_split_modules / all_tied_weights_keys",
        "built on a tiny Llama", "hf_ext/model_info.py, hf_ext/saving/export.py, hf_ext/saving/writer.py "
        "tied_target_keys, hf_ext/fsdp/engine.py wrap_repeated_layers", from_config_and_tied_keys),
    Pin("transformers", "PreTrainedModel._tp_size, read by Trainer.get_tp_size", "source lines",
        "hf_ext/batching.py layout_of", source_has(f"{T}.get_tp_size", 'getattr(self.model, "_tp_size", None)')),
    Pin("transformers", "Trainer.model_accepts_loss_kwargs", "source lines (Trainer.__init__)",
        "hf_ext/trainer.py TrainerMixin.__init__",
        source_has(f"{T}.__init__", "self.model_accepts_loss_kwargs = ")),
    Pin("transformers", "TrainingArguments.fsdp_plugin_args", "source lines (__post_init__)",
        "hf_ext/fsdp/engine.py _requested_plugin",
        source_has("transformers:TrainingArguments.__post_init__", "self.fsdp_plugin_args = ")),
    Pin("transformers", "HfTrainerDeepSpeedConfig.trainer_config_process / trainer_config_finalize", "source sha256",
        "hf_ext/deepspeed/resolve.py (fills every \"auto\" as they do, and more)",
        all_of(source_hash("transformers.integrations.deepspeed:HfTrainerDeepSpeedConfig.trainer_config_process",
                           "c07058fd36add73de61086c7022447c80228278fa75c1b58b9ebb05314ec00d9"),
               source_hash("transformers.integrations.deepspeed:HfTrainerDeepSpeedConfig.trainer_config_finalize",
                           "bfe83ae4d41c6eed9b9d5ac6ddd02a1810f47357b1500f8f11f00fa1da859494"))),
    Pin("transformers", "HfTrainerDeepSpeedConfig.mismatches", "source lines", "hf_ext/training_args.py __post_init__",
        source_has("transformers.integrations.deepspeed:HfTrainerDeepSpeedConfig", "self.mismatches = []",
                   "self.mismatches.append(")),
    # accelerate
    Pin("accelerate", "Accelerator._models", "source lines",
        "hf_ext/evaluation/zero_eval.py and hf_ext/fsdp/engine.py shard_for_evaluation",
        source_has("accelerate:Accelerator.__init__", "self._models = []")),
    Pin("accelerate", "AcceleratorState FSDP gate / PartialState._shared_state", "source lines",
        "hf_ext/fsdp/engine.py enable_on_trainer", accelerate_gate_leaves_cpu_out),
    Pin("accelerate", "ParallelismConfig._validate_accelerator", "signature", "hf_ext/fsdp/engine.py enable_on_trainer",
        signature("accelerate.parallelism_config:ParallelismConfig._validate_accelerator", ["self", "accelerator"])),
    Pin("accelerate", "DeepSpeedPlugin.hf_ds_config", "source lines",
        "hf_ext/deepspeed/callbacks.py, hf_ext/saving/resume.py _set_accumulation",
        source_has("accelerate.utils:DeepSpeedPlugin.__post_init__", "self.hf_ds_config = HfDeepSpeedConfig(")),
    Pin("accelerate", "DeepSpeedPlugin.__post_init__ (an accelerate YAML's inline DeepSpeed settings)", "source sha256",
        "hf_ext/deepspeed/load.py _from_accelerate (builds the same config from the YAML)",
        source_hash("accelerate.utils:DeepSpeedPlugin.__post_init__",
                    "9ddd7651ee38f6105e5964881f1aa961fd7dfc368630ee958ba1c55f55fd30b4")),
    Pin("accelerate", "accelerate launch's ACCELERATE_* DeepSpeed variables", "source lines (prepare_deepspeed_cmd_env)",
        "hf_ext/deepspeed/load.py accelerate_launch_config, hf_ext/training_args.py _accelerate_inline_fields_consumed",
        accelerate_launch_variables),
    Pin("accelerate", "accelerate.utils.fsdp2_prepare_model", "signature", "hf_ext/fsdp/engine.py shard_for_evaluation",
        signature("accelerate.utils:fsdp2_prepare_model", ["accelerator", "model"])),
    Pin("accelerate", "launch_command_parser()._actions", "called; its fsdp_* dests",
        "hf_ext/fsdp/config.py accelerate_fsdp_keys", accelerate_fsdp_options),
    # DeepSpeed
    Pin("deepspeed", "DeepSpeedEngine._configure_basic_optimizer", "source sha256",
        "hf_ext/deepspeed/schema.py optimizer_parameters and _ADAM_POPPED",
        source_hash(f"{ENGINE}._configure_basic_optimizer",
                    "fdd125c71f9b392924d7e6757ed5406e9c52126c4c5d2491bc454f0bf8c9c8d4")),
    Pin("deepspeed", "_REMOVED_TOP_LEVEL_CONFIG_KEYS / _REMOVED_ZERO_CONFIG_KEYS", "read: {key: message} dicts",
        "hf_ext/deepspeed/versions.py _deepspeed_tables, schema.py suggestable_top_level_keys", removed_key_tables),
    Pin("deepspeed", "DeepSpeedConfig's key look-ups", "a config parsed through a recording dict",
        "hf_ext/deepspeed/schema.py known_top_level_keys", config_parse_looks_keys_up),
    Pin("deepspeed", "DeepSpeedEngine._config.load_universal_checkpoint / latest_universal",
        "a parsed config; load_checkpoint's source lines", "hf_ext/saving/resume.py apply_resume_plan, LATEST_UNIVERSAL",
        engine_config_switches_load_universal),
    Pin("deepspeed", "checkpoint layout (latest, *_model_states.pt, *zero_pp_rank_*_optim_states.pt, ds_config, "
        "dp_world_size)", "the engine's naming methods called; save source lines",
        "hf_ext/saving/resume.py read_zero_checkpoint, hf_ext/saving/model_dir.py has_zero_checkpoint",
        checkpoint_file_names),
    Pin("deepspeed", "ds_to_universal's command line", "parse_arguments called",
        "hf_ext/saving/resume.py convert_to_universal", ds_to_universal_flags),
    Pin("deepspeed", "param._hp_mapping (ZeRO-1/2)", "link_hp_params called; safe_get_full_* dispatch",
        "hf_ext/peft.py _deepspeed_param", hp_mapping_of_zero12_params),
    Pin("deepspeed", "ZeRO-3 param.ds_id / ds_shape / ds_numel", "source lines (Init._convert_to_deepspeed_param)",
        "hf_ext/gather.py is_partitioned, hf_ext/saving/writer.py _full_shape, hf_ext/evaluation/gathered.py",
        source_has("deepspeed.runtime.zero.partition_parameters:Init._convert_to_deepspeed_param",
                   "param.ds_shape = param.shape", "param.ds_numel = param.numel()", "param.ds_id = ")),
    Pin("deepspeed", "ZeRO optimizers' flat fp32 partitions and .optimizer", "source lines",
        "hf_ext/peft.py _ensure_optimizer_state, _inner_optimizer",
        all_of(source_has("deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer.__init__",
                          "self.optimizer = init_optimizer", "self.single_partition_of_fp32_groups = []",
                          "param_group['params'] = [self.single_partition_of_fp32_groups[i]]"),
               source_has("deepspeed.runtime.zero.stage3:DeepSpeedZeroOptimizer_Stage3",
                          "self.optimizer = init_optimizer", "self.fp32_partitioned_groups_flat = []",
                          "self.optimizer.state[self.fp32_partitioned_groups_flat[i]]"))),
    Pin("deepspeed", "DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state", "signature; source lines",
        "hf_ext/peft.py _ensure_optimizer_state (ZeRO-1/2 link the parameters' views of the optimizer state at the "
        "first step only; a PEFT resume writes through them before one)",
        all_of(signature("deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state",
                         ["self"]),
               source_has("deepspeed.runtime.zero.stage_1_and_2:DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state",
                          "if not self._hp_optimizer_states_linked:", "self._hp_optimizer_states_linked = True"))),
    Pin("deepspeed", "cdb.shm_comm_op and the shm workspace name", "module global; TorchBackend and shm.cpp source",
        "hf_ext/runtime.py release_deepspeed_shm_names, _deepspeed_shm_path", shm_comm_op_and_name),
    Pin("deepspeed", "LR schedulers' last_batch_iteration", "WarmupLR built and stepped", "hf_ext/schedule.py scheduled_lrs",
        deepspeed_scheduler_step),
    # TRL (hf_ext/trl.py)
    Pin("trl", "prepare_deepspeed copies the trainer's DeepSpeed config; DPOTrainer/KTOTrainer call it in __init__",
        "source lines", "hf_ext/trl.py, hf_ext/trainer.py create_accelerator_and_postprocess (the config is complete "
        "before TRL copies it)",
        all_of(source_has("trl.models.utils:prepare_deepspeed",
                          "config_kwargs = deepcopy(deepspeed_plugin.deepspeed_config)"),
               source_has("trl.trainer.dpo_trainer:DPOTrainer.__init__",
                          "self.ref_model = prepare_deepspeed(self.ref_model, self.accelerator)"),
               source_has("trl.trainer.kto_trainer:KTOTrainer.__init__",
                          "self.ref_model = prepare_deepspeed(self.ref_model, self.accelerator)"))),
    Pin("trl", "_BaseConfig.__post_init__ (bf16 default)", "source lines", "hf_ext/trl.py _TrlConfig.__post_init__",
        source_has("trl.trainer.base_config:_BaseConfig.__post_init__",
                   "self.bf16 = not (self.fp16) if self.bf16 is None else self.bf16")),
    Pin("trl", "SFTTrainer / DPOTrainer / KTOTrainer._save_checkpoint", "source sha256",
        "hf_ext/trl.py _TrlTrainer._save_checkpoint (does what they add: the model card)",
        all_of(*(source_hash(f"trl:{name}._save_checkpoint",
                             "b6ee0a370c266b6f6ada183d32719e4f689ac7a54086c1ec40a69a79e79921c6") for name in ("SFTTrainer", "DPOTrainer", "KTOTrainer")))),
    # Gradio (chat_e: the app's server, its login by API key, its chat window)
    Pin("gradio", "App.tokens, App.cookie_id and the access-token cookies", "source lines",
        "chat_e/http/guard.py RequestGuard._as_session (an API key logs a request in as Gradio's login would: its session "
        "token in app.tokens, under the cookies Gradio reads)",
        all_of(source_has("gradio.routes:App.__init__", "self.tokens = {}", "self.cookie_id = secrets.token_urlsafe(32)"),
               source_has("gradio.routes:App.create_app", 'f"access-token-{app.cookie_id}"',
                          'request.cookies.get(f"access-token-unsecure-{app.cookie_id}")', "return app.tokens.get(token)"))),
    Pin("gradio", "App.stop_event ends the heartbeat streams (Blocks.close sets it)", "source lines",
        "chat_e/server.py serve (a stopping server sets it, as Gradio's launch does when it closes)",
        all_of(source_has("gradio.routes:App.__init__", "self.stop_event = utils.safe_get_stop_event()"),
               source_has("gradio.routes:App.create_app", "stop_stream_task = asyncio.create_task(app.stop_event.wait())"),
               source_has("gradio.blocks:Blocks.close", "self.app.stop_event.set()"))),
    Pin("gradio", "Blocks.state_session_capacity", "source lines",
        "chat_e/server.py (--max_sessions set on the Blocks before the server starts, as launch sets it)",
        all_of(source_has("gradio.blocks:Blocks.launch", "self.state_session_capacity = state_session_capacity"),
               source_has("gradio.state_holder:StateHolder.set_blocks",
                          "self.capacity = blocks.state_session_capacity"))),
    Pin("gradio", "a component's data_model validates its input before any handler", "source lines",
        "chat_e/web/ui.py checked_chat_model (the chat window's model, with a clear refusal of a malformed chat)",
        all_of(source_has("gradio.components.chatbot:Chatbot", "data_model = ChatbotDataMessages"),
               source_has("gradio.blocks:Blocks.preprocess_data", 'if getattr(block, "data_model", None)',
                          "inputs_cached = data_model.model_validate("))),
    # torch, argparse
    Pin("torch", "profile().profiler.kineto_results", "a profile of one allocation", "hf_ext/memory/probe.py PeakTensorBytes",
        profiler_memory_events),
    Pin("torch", "Module._parameters / _buffers / _non_persistent_buffers_set", "read and rebound on a Linear",
        "hf_ext/evaluation/gathered.py gathered_copy, hf_ext/saving/writer.py model_entries", module_tensor_dicts),
    Pin("torch", "LambdaLR.state_dict() keys", "a stepped LambdaLR's state", "hf_ext/saving/convert.py _schedule_position",
        lambda_lr_state_keys),
    Pin("torch", "torch.ao.quantization.quantize_dynamic (deprecated)", "two Linears, one named",
        "chat_e/engines/local.py quantize_int8", dynamic_int8_linear),
    Pin("argparse", "ArgumentParser._actions", "read on an HfArgumentParser", "hf_ext/config_args.py", argparse_actions),
]  # fmt: skip


@pytest.mark.parametrize("pin", PINS, ids=lambda pin: f"{pin.library}:{pin.internal}")
def test_private_internal_is_what_hf_ext_was_written_against(pin):
    message = failure(pin)
    assert message is None, message


def test_a_changed_internal_fails_by_name(monkeypatch):
    """The check is not vacuous: a different ``_configure_basic_optimizer`` and a missing removed-keys table are
    reported, each by name, with the hf-ext code to re-read."""
    from deepspeed.runtime import config as ds_config
    from deepspeed.runtime.engine import DeepSpeedEngine

    def _configure_basic_optimizer(self, model_parameters):
        return None

    by_name = {pin.internal: pin for pin in PINS}
    monkeypatch.setattr(DeepSpeedEngine, "_configure_basic_optimizer", _configure_basic_optimizer)
    message = failure(by_name["DeepSpeedEngine._configure_basic_optimizer"])
    assert message is not None and "deepspeed changed DeepSpeedEngine._configure_basic_optimizer" in message
    assert "hf_ext/deepspeed/schema.py" in message

    monkeypatch.delattr(ds_config, "_REMOVED_ZERO_CONFIG_KEYS")
    message = failure(by_name["_REMOVED_TOP_LEVEL_CONFIG_KEYS / _REMOVED_ZERO_CONFIG_KEYS"])
    assert message is not None and "_REMOVED_ZERO_CONFIG_KEYS" in message and "AttributeError" in message


def test_every_pin_names_existing_hf_ext_code():
    root = Path(__file__).resolve().parents[2]
    for pin in PINS:
        for path in {word.rstrip(",") for word in pin.ours.split() if word.startswith(("hf_ext/", "chat_e/"))}:
            assert (root / path).is_file(), f"{pin.internal}: {path} does not exist"
