"""Every private part of transformers (and accelerate) hf-ext overrides, patches or calls, pinned to the source it was
written against. When one of these fails after an upgrade, re-read the hf-ext code named in the message against the
new source, adapt it, then update the pin here and the transformers range in pyproject.toml.

What is touched, and why no public hook does it:

* ``Trainer._save_checkpoint`` (overridden by ``hf_ext.saving.checkpoints.save_checkpoint_atomically``): stock writes
  into ``checkpoint-N`` and rotates older checkpoints away on rank 0 before the other ranks finish writing; both
  happen before any public hook runs, so a crash there can lose the newest complete checkpoint.
* ``Trainer._load_optimizer_and_scheduler`` (overridden by ``hf_ext.trainer``): the stock loader reads per-rank
  optimizer files only; hf-ext's PEFT checkpoints hold the state by parameter name, for any world size.
* ``transformers.trainer.deepspeed_load_checkpoint`` (patched while ``train`` runs,
  ``hf_ext.saving.resume.deepspeed_resume``): it raises without a ZeRO checkpoint of the same world size, before
  ``_load_optimizer_and_scheduler`` runs; a checkpoint of another world size is loaded from its universal conversion.
* ``DeepSpeedEngine._config.load_universal_checkpoint`` (set around that one load, same module): the switch DeepSpeed's
  ``load_checkpoint`` reads; the engine was started without it so that its own config stays the user's.
* ``Accelerator._models`` (``hf_ext.evaluation.zero_eval``): the models accelerate prepared, restored after an
  engine-free evaluation on ZeRO-1/2; and (``hf_ext.fsdp.engine.shard_for_evaluation``) the FSDP2 model sharded
  before an evaluation, recorded there so that stock ``evaluation_loop`` does not prepare it alone.
* ``AcceleratorState.distributed_type`` / ``PartialState._shared_state`` (``hf_ext.fsdp.engine``): set to FSDP on CPU
  ranks, where accelerate drops its FSDP plugin; accelerate writes the same shared-state key itself at the end of
  ``AcceleratorState.__init__``. ``ParallelismConfig._validate_accelerator``: the check accelerate runs on a device
  mesh, run again once the state is FSDP (hybrid sharding).
"""

from __future__ import annotations

import hashlib
import inspect

import pytest
import transformers.trainer as hf_trainer
from accelerate import Accelerator
from transformers import Trainer

#: sha256 of ``inspect.getsource`` of each overridden method, transformers 5.23.0
SOURCE_PINS = {
    "_save_checkpoint": ("a9111e30faa9933986e022e56b5af81fd990356db64d727b4c320c852283bf3b", "hf_ext/saving/checkpoints.py"),
    "_load_optimizer_and_scheduler": ("741032f57d6fb80211506bf521f67bdd0ff876ad39cc50e700c9c2bab2efb251", "hf_ext/trainer.py"),
}  # fmt: skip

#: private Trainer methods save_checkpoint_atomically calls, with the parameters it passes
CALLED_HELPERS = {
    "_get_output_dir": ["self", "trial"],
    "_save_optimizer_and_scheduler": ["self", "output_dir"],
    "_save_scaler": ["self", "output_dir"],
    "_save_rng_state": ["self", "output_dir"],
    "_push_from_checkpoint": ["self", "checkpoint_folder"],
    "store_flos": ["self"],
}


@pytest.mark.parametrize("name", sorted(SOURCE_PINS))
def test_overridden_methods_are_the_ones_hf_ext_was_written_against(name):
    digest, ours = SOURCE_PINS[name]
    source = inspect.getsource(getattr(Trainer, name))
    assert hashlib.sha256(source.encode()).hexdigest() == digest, (
        f"transformers changed Trainer.{name}: re-read {ours} against it, then update SOURCE_PINS"
    )


@pytest.mark.parametrize("name", sorted(CALLED_HELPERS))
def test_called_private_helpers_keep_their_signature(name):
    params = list(inspect.signature(getattr(Trainer, name)).parameters)
    assert params == CALLED_HELPERS[name], f"Trainer.{name} changed: adapt hf_ext/saving/checkpoints.py"


def test_deepspeed_resume_patch_point():
    # the patched name is the module global the training loop calls, and the loader runs after it
    assert list(inspect.signature(hf_trainer.deepspeed_load_checkpoint).parameters) == [
        "deepspeed_engine",
        "checkpoint_path",
        "load_module_strict",
    ]
    loop = inspect.getsource(Trainer._prepare_for_training)
    patched_call = loop.index("deepspeed_load_checkpoint(")
    assert patched_call < loop.index("self._load_optimizer_and_scheduler(resume_from_checkpoint)"), (
        "transformers reordered the DeepSpeed resume: re-read hf_ext/saving/resume.py deepspeed_resume"
    )


def test_accelerator_keeps_its_prepared_models_in_a_list():
    assert "self._models = []" in inspect.getsource(Accelerator.__init__), (
        "accelerate changed Accelerator._models: re-read hf_ext/evaluation/zero_eval.py and hf_ext/fsdp/engine.py"
    )
    from transformers import Trainer

    assert "len(self.accelerator._models) == 0" in inspect.getsource(Trainer.evaluation_loop), (
        "transformers changed when evaluation_loop prepares the model: re-read hf_ext/fsdp/engine.py "
        "shard_for_evaluation"
    )


def test_deepspeed_reads_load_universal_from_the_engine_config():
    # hf_ext.saving.resume switches load_universal on for one load through the engine's parsed config
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.engine import DeepSpeedEngine

    config = DeepSpeedConfig({"train_batch_size": 1, "checkpoint": {"load_universal": True}})
    assert config.load_universal_checkpoint is True
    assert "return self._config.load_universal_checkpoint" in inspect.getsource(
        DeepSpeedEngine.load_universal_checkpoint
    )
    assert "self.load_universal_checkpoint()" in inspect.getsource(DeepSpeedEngine.load_checkpoint)


def test_accelerate_drops_fsdp_on_cpu_ranks_and_shares_the_distributed_type():
    """hf-ext switches CPU ranks to FSDP because accelerate's gate leaves MULTI_CPU out; when this fails, accelerate
    changed that gate or where it records the type: re-read hf_ext/fsdp/engine.py."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.state import AcceleratorState

    source = inspect.getsource(AcceleratorState.__init__)
    gate = source[source.index("elif self.distributed_type in [") : source.index("DistributedType.FSDP\n")]
    assert "DistributedType.MULTI_GPU" in gate and "DistributedType.MULTI_CPU" not in gate
    assert 'PartialState._shared_state["distributed_type"] = self.distributed_type' in source
    assert list(inspect.signature(ParallelismConfig._validate_accelerator).parameters) == ["self", "accelerator"]
