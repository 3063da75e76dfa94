"""The doctor's version-dependent rules (hf_ext.deepspeed.versions), one test per rule.

Oracle: the installed DeepSpeed itself. Every removed feature in the table must be one that DeepSpeed's own config
parser refuses (so an error here is never a false alarm on this release), the fix given must make the config
resolve, and the warm-up rule must match what DeepSpeed's scheduler raises. A faked older DeepSpeed (the doctor's view
of the installed versions replaced) turns each error into a warning that names the release that refuses it.
"""

from __future__ import annotations

import copy

import pytest
from packaging.version import Version

from hf_ext.cli import main
from hf_ext.deepspeed import versions

from .test_config_refusals import BASE, problems_of, resolves, the_one_problem, variant

pytestmark = pytest.mark.usefixtures("no_global_deepspeed_config")


def with_key(dotted: str) -> dict:
    """BASE holding the removed feature ``dotted`` (a block, a flag or a number: DeepSpeed refuses the key itself)."""
    config = copy.deepcopy(BASE)
    if dotted == "optimizer.type":
        config["optimizer"]["type"] = "OneBitAdam"
    elif dotted.startswith("zero_optimization."):
        config["zero_optimization"][dotted.split(".")[1]] = 2
    else:
        config[dotted] = True if dotted == "sparse_gradients" else {"enabled": True}
    return config


REMOVALS = {**versions.REMOVED, "optimizer.type": versions.ONE_BIT_REMOVAL}


@pytest.mark.parametrize("key", list(REMOVALS))
def test_a_removed_feature_names_its_release_and_change_and_the_fix_resolves(key, tmp_path):
    from deepspeed.runtime.config import DeepSpeedConfig

    config, removal = with_key(key), REMOVALS[key]
    probe = {k: v for k, v in config.items() if k not in ("optimizer", "scheduler")} | {"train_batch_size": 1}
    if key == "optimizer.type":  # not a config error: the engine asserts on an optimizer it no longer has
        from deepspeed.runtime.config import DEEPSPEED_OPTIMIZERS

        assert "onebitadam" not in DEEPSPEED_OPTIMIZERS
    else:
        with pytest.raises(Exception, match="removed"):  # this DeepSpeed refuses it: an error here is never spurious
            DeepSpeedConfig(probe)
    assert Version(removal.release) <= versions.installed()["deepspeed"]
    problem = the_one_problem(config, tmp_path)
    assert problem.key == key
    assert f"DeepSpeed {removal.release}" in problem.message and removal.change in problem.message
    assert problem.fix == removal.fix
    fixed = copy.deepcopy(config)
    if key == "optimizer.type":
        fixed["optimizer"]["type"] = "AdamW"  # the fix's suggestion
    elif "." in key:
        del fixed["zero_optimization"][key.split(".")[1]]
    else:
        del fixed[key]
    resolves(fixed, tmp_path)


def test_an_older_deepspeed_is_warned_that_the_next_release_refuses_it(tmp_path, monkeypatch):
    older = dict(versions.installed(), deepspeed=Version("0.19.6"))
    monkeypatch.setattr(versions, "_deepspeed_tables", dict)  # 0.19.6 had no removal table
    monkeypatch.setattr(versions, "installed", lambda: older)
    config = variant(elasticity={"enabled": True}, zero_optimization__zeropp_loco_param=2)
    from hf_ext import explain_deepspeed_config

    from ..ds_support import make_args

    resolution = explain_deepspeed_config(config, make_args(tmp_path), None, 1, defer=True, raise_errors=False)
    assert not [p for p in resolution.problems if p.key in ("elasticity", "zero_optimization.zeropp_loco_param")]
    warned = [w for w in resolution.warnings if w.startswith(("elasticity:", "zero_optimization.zeropp_loco_param:"))]
    assert len(warned) == 2 and all("DeepSpeed 0.19.6 still takes it" in w for w in warned), resolution.warnings
    assert "DeepSpeed 0.19.8, deepspeedai/DeepSpeed#8563" in warned[0]


def test_a_removal_only_deepspeeds_table_knows_is_still_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(versions, "_deepspeed_tables", lambda: {"new_feature": "New feature has been removed"})
    config = variant(new_feature={"enabled": True})
    problems = [p for p in problems_of(config, tmp_path) if p.key == "new_feature"]
    assert len(problems) == 1 and "New feature has been removed" in problems[0].message


def test_zero_warmup_steps_are_refused_from_deepspeed_0_19_3(tmp_path, monkeypatch):
    import torch
    from deepspeed.runtime.lr_schedules import WarmupLR

    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(ValueError, match="warmup_num_steps must be a positive integer"):  # what the rule foresees
        WarmupLR(optimizer, warmup_num_steps=0)
    config = variant(scheduler__params__warmup_num_steps=0)
    problem = the_one_problem(config, tmp_path)
    assert problem.key == "scheduler.params.warmup_num_steps" and "deepspeedai/DeepSpeed#8126" in problem.message
    resolves(variant(scheduler__params__warmup_num_steps=1), tmp_path)  # the fix
    older = dict(versions.installed(), deepspeed=Version("0.19.2"))
    monkeypatch.setattr(versions, "installed", lambda: older)
    assert not [p for p in problems_of(config, tmp_path) if p.key == "scheduler.params.warmup_num_steps"]


def test_the_doctor_prints_the_versions_and_the_rules_that_applied(tmp_path, capsys):
    path = tmp_path / "elastic.json"
    path.write_text('{"elasticity": {"enabled": true, "max_train_batch_size": 64}, "train_batch_size": "auto"}')
    assert main(["ds", "doctor", str(path), "--output_dir", str(tmp_path)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("error: elasticity: this feature was removed in DeepSpeed 0.19.8")
    assert "torchrun --nnodes MIN:MAX" in lines[0]
    installed = versions.installed()
    assert lines[1] == "versions: " + ", ".join(f"{p} {installed[p]}" for p in versions.PACKAGES)
    assert lines[2:] == ["version rule: elasticity: removed in DeepSpeed 0.19.8, deepspeedai/DeepSpeed#8563"]


def test_the_doctor_lists_the_ulysses_correction_on_the_versions_it_was_measured_on(tmp_path, capsys, monkeypatch):
    """``--sp_size 2``: the run's Ulysses (hf_ext.loss.ULYSSES_SUMMED_GRADIENT; the 2-rank run that measured it:
    tests/distributed/test_parallel_layouts.py). The installed transformers and DeepSpeed are those versions; a
    faked transformers 5.24 is not, and the doctor then has no rule to list."""
    argv = ["ds", "doctor", "zero2", "--world_size", "2", "--sp_size", "2", "--output_dir", str(tmp_path)]
    installed = versions.installed()
    assert installed["transformers"].release[:2] == (5, 23) and installed["deepspeed"].release[:2] == (0, 19)
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("ok: ")
    assert lines[1] == "versions: " + ", ".join(f"{p} {installed[p]}" for p in versions.PACKAGES)
    assert len(lines) == 3 and lines[2].startswith("version rule: parallelism_config.sp_size 2 (Ulysses): ")
    for cited in ("transformers>=5.23,<5.24 with deepspeed>=0.19,<0.20", "huggingface/transformers#47073",
                  "divides the gradient by 2"):  # fmt: skip
        assert cited in lines[2]
    # without sequence parallelism, or on another transformers, nothing is corrected
    assert main(argv[:4] + argv[6:]) == 0
    assert "version rule" not in capsys.readouterr().out
    monkeypatch.setattr(versions, "installed", lambda: dict(installed, transformers=Version("5.24.0")))
    assert main(argv) == 0
    assert "version rule" not in capsys.readouterr().out
