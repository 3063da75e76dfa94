"""FSDP settings: presets, "auto" values, and every problem in one line with a fix that works."""

from __future__ import annotations

import pytest

from hf_ext.errors import FsdpConfigError
from hf_ext.fsdp.config import resolve_fsdp

from ..conftest import ROOT


def problems(**kwargs) -> list[str]:
    with pytest.raises(FsdpConfigError) as err:
        resolve_fsdp(**kwargs)
    lines = str(err.value).splitlines()[1:]
    assert all(line.startswith("- ") for line in lines)  # one line each
    return lines


def test_presets():
    full = resolve_fsdp("full_shard", world_size=4, local_world_size=4)
    assert (full.sharding, full.fsdp, full.sharding_factor, full.replicas) == ("full_shard", True, 4, 1)
    assert full.fsdp_config == {"state_dict_type": "SHARDED_STATE_DICT", "reshard_after_forward": True}
    grad_op = resolve_fsdp("shard_grad_op", world_size=2, local_world_size=2)
    assert grad_op.fsdp_config["reshard_after_forward"] is False
    # hybrid, "auto" factor: shard inside a node (4 ranks), replicate across the 2 nodes
    hybrid = resolve_fsdp("hybrid_shard", world_size=8, local_world_size=4)
    assert (hybrid.sharding, hybrid.sharding_factor, hybrid.replicas, hybrid.hybrid) == ("hybrid_shard", 4, 2, True)
    assert "sharding_factor" not in hybrid.fsdp_config  # hf-ext's key, not passed to accelerate
    # no_shard: FSDP2 has none; every rank holds everything, which is DDP
    none = resolve_fsdp("no_shard", world_size=2, local_world_size=2)
    assert (none.sharding, none.fsdp, none.replicas) == ("no_shard", None, 2)
    assert resolve_fsdp("hybrid_shard", {"sharding_factor": 1}, world_size=2, local_world_size=2).fsdp is None
    assert resolve_fsdp("hybrid_shard", {"sharding_factor": 2}, world_size=2).sharding == "full_shard"
    assert resolve_fsdp(True, world_size=2).sharding == "full_shard"  # bare --fsdp
    assert resolve_fsdp("full_shard offload", world_size=2).fsdp_config["cpu_offload"] is True


def test_auto_values_and_accelerate_prefixes():
    resolved = resolve_fsdp("full_shard", {"fsdp_transformer_layer_cls_to_wrap": "auto", "state_dict_type": "auto"})
    assert "transformer_layer_cls_to_wrap" not in resolved.fsdp_config  # accelerate then wraps _no_split_modules
    assert resolved.fsdp_config["state_dict_type"] == "SHARDED_STATE_DICT"
    kept = resolve_fsdp("full_shard", {"state_dict_type": "FULL_STATE_DICT", "transformer_layer_cls_to_wrap": ["X"]})
    assert kept.fsdp_config["state_dict_type"] == "FULL_STATE_DICT"
    assert kept.fsdp_config["transformer_layer_cls_to_wrap"] == ["X"]


def test_unknown_key_names_the_close_match_and_the_fix_works():
    (line,) = problems(fsdp="hybrid_shard", fsdp_config={"sharding_factr": 2}, world_size=4, local_world_size=4)
    assert line == "- fsdp_config.sharding_factr: unknown key. Fix: did you mean 'sharding_factor'?"
    fixed = resolve_fsdp("hybrid_shard", {"sharding_factor": 2}, world_size=4, local_world_size=4)
    assert (fixed.sharding_factor, fixed.replicas) == (2, 2)


def test_unknown_option_and_conflicts():
    (line,) = problems(fsdp="full_shrd", world_size=2)
    assert "unknown option 'full_shrd'" in line and "did you mean 'full_shard'?" in line
    (line,) = problems(fsdp="full_shard", deepspeed="zero3", world_size=2)
    assert "both `fsdp` and `deepspeed`" in line and "pass only one of --fsdp and --deepspeed" in line
    (line,) = problems(fsdp="full_shard no_shard", world_size=2)
    assert "several sharding strategies" in line


def test_sharding_factor_must_divide_the_ranks():
    (line,) = problems(fsdp="hybrid_shard", fsdp_config={"sharding_factor": 3}, world_size=4)
    assert line == ("- fsdp_config.sharding_factor: 3 does not divide the 4 ranks into equal groups. Fix: set it to "
                    'one of 1, 2, 4 (or "auto": the ranks of one node)')  # fmt: skip
    (line,) = problems(fsdp="full_shard", fsdp_config={"sharding_factor": 2}, world_size=4)
    assert "only hybrid_shard uses a sharding factor" in line


def test_fsdp1_on_cpu_is_refused_with_the_fix():
    (line,) = problems(fsdp="full_shard", fsdp_config={"version": 1}, world_size=2, has_accelerator=False)
    assert "FSDP1 does not run on CPU-only ranks" in line and "set it to 2" in line
    assert resolve_fsdp("full_shard", {"version": 2}, world_size=2).fsdp is True
    assert resolve_fsdp("full_shard", {"version": 1}, world_size=2, has_accelerator=True).fsdp is True


def test_all_problems_at_once():
    lines = problems(fsdp="hybrid_shard", fsdp_config={"verison": 2, "sharding_factor": 5, "state_dict_type": "x"},
                     world_size=4)  # fmt: skip
    assert len(lines) == 3
    assert [line.split(":")[0] for line in lines] == [
        "- fsdp_config.verison", "- fsdp_config.state_dict_type", "- fsdp_config.sharding_factor",
    ]  # fmt: skip


def test_training_arguments_resolve_and_refuse(tmp_path):
    import hf_ext

    args = hf_ext.TrainingArguments(output_dir=str(tmp_path), fsdp="full_shard", report_to=[])
    assert args.fsdp is True and args.fsdp_resolution.sharding == "full_shard"
    assert args.fsdp_plugin_args["state_dict_type"] == "SHARDED_STATE_DICT"
    assert args.fsdp_plugin_args["reshard_after_forward"] is True
    with pytest.raises(FsdpConfigError, match="fsdp_config.min_num_param: unknown key"):
        hf_ext.TrainingArguments(output_dir=str(tmp_path), fsdp="full_shard", fsdp_config={"min_num_param": 1})
    ddp = hf_ext.TrainingArguments(output_dir=str(tmp_path), fsdp="no_shard", report_to=[])
    assert not ddp.fsdp and ddp.fsdp_plugin_args is None


# --- accelerate config files: what accelerate launch would ignore or refuse -----------------------------------------


def accelerate_file(tmp_path, **fsdp_config) -> str:
    import yaml

    path = tmp_path / "fsdp.yaml"
    config = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP", "machine_rank": 0,
              "num_machines": 1, "num_processes": 2, "fsdp_config": fsdp_config}  # fmt: skip
    path.write_text(yaml.safe_dump(config))
    return str(path)


def accelerate_problems(path) -> list[str]:
    from hf_ext.fsdp.config import resolve_accelerate_config

    with pytest.raises(FsdpConfigError) as err:
        resolve_accelerate_config(path)
    return [str(p) for p in err.value.problems]


def test_the_recipe_accelerate_file_passes():
    from hf_ext.fsdp.config import resolve_accelerate_config

    resolution, world_size = resolve_accelerate_config(ROOT / "recipes" / "accelerate" / "fsdp.yaml")
    assert (resolution.sharding, resolution.sharding_factor, world_size) == ("full_shard", 2, 2)


def test_accelerate_file_typo_and_missing_version_and_the_fixes_work(tmp_path):
    from hf_ext.fsdp.config import resolve_accelerate_config

    # accelerate launch takes this file without a word: the typo is ignored and FSDP1 (its default) is asked for
    found = accelerate_problems(accelerate_file(tmp_path, fsdp_reshard_after_forwrd=False))
    assert found == [
        "fsdp_config.fsdp_reshard_after_forwrd: unknown key: accelerate launch ignores it. "
        "Fix: did you mean 'fsdp_reshard_after_forward'?",
        "fsdp_config.fsdp_version: FSDP1 does not run on CPU-only ranks (and is deprecated). "
        "Fix: set fsdp_version: 2 (accelerate launch runs FSDP1 when the file names no version)",
    ]
    fixed = accelerate_file(tmp_path, fsdp_reshard_after_forward=False, fsdp_version=2)
    resolution, _ = resolve_accelerate_config(fixed)
    assert resolution.sharding == "shard_grad_op" and resolution.fsdp_config["reshard_after_forward"] is False


def test_accelerate_file_fsdp1_key_under_fsdp2(tmp_path):
    found = accelerate_problems(accelerate_file(tmp_path, fsdp_version=2, fsdp_sharding_strategy="FULL_SHARD"))
    assert found == [
        "fsdp_config.fsdp_sharding_strategy: an FSDP1 setting, which FSDP2 ignores. Fix: use "
        "fsdp_reshard_after_forward: true (full shard) or false (shard_grad_op)"
    ]
