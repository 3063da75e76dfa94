"""The classification recipe under ``accelerate launch`` with a DeepSpeed plugin YAML: DeepSpeed ZeRO-2 really runs
although the script holds no DeepSpeed code, and the offline topic task is learned (checked on the saved model)."""

from __future__ import annotations

import ast
import json

import pytest
import torch

from ..conftest import ROOT, launcher_cmd, run

pytestmark = pytest.mark.distributed

RECIPE = ROOT / "recipes" / "classification.py"


def test_the_script_holds_no_deepspeed_code():
    tree = ast.parse(RECIPE.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(node)}  # fmt: skip
    names = [
        node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else node.value
        for node in ast.walk(tree)
        if isinstance(node, (ast.Name, ast.Attribute))
        or (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings)
    ]
    imports = [alias.name for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
               for alias in node.names] + [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]  # fmt: skip
    assert not [n for n in names + imports if "deepspeed" in n.lower()]


@pytest.fixture(scope="module")
def topics_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("topics") / "run"
    cmd = [*launcher_cmd(f"accelerate:{ROOT / 'recipes' / 'accelerate' / 'zero2.yaml'}", RECIPE),
           "--config", str(ROOT / "recipes" / "configs" / "topics.yaml"), "--output_dir", str(out)]  # fmt: skip
    run(cmd)
    return out


def test_accelerate_with_a_deepspeed_plugin_runs_zero2(topics_run):
    summary = json.loads((topics_run / "all_results.json").read_text())["run"]
    assert (summary["launcher"], summary["world_size"]) == ("accelerate", 2)
    assert (summary["engine"], summary["zero_stage"]) == ("DeepSpeedEngine", 2)


def test_the_saved_classifier_beats_the_majority_class_on_the_test_split(topics_run):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from chat_e.data.corpora import load_chatterbot_topics

    results = json.loads((topics_run / "all_results.json").read_text())
    test = load_chatterbot_topics()["test"]
    model = AutoModelForSequenceClassification.from_pretrained(topics_run).eval()
    tokenizer = AutoTokenizer.from_pretrained(topics_run)
    assert model.config.id2label == dict(enumerate(test.features["label"].names))
    with torch.no_grad():
        batch = tokenizer(list(test["text"]), truncation=True, max_length=128, padding=True, return_tensors="pt")
        predictions = model(**batch).logits.argmax(-1)
    accuracy = (predictions == torch.tensor(list(test["label"]))).float().mean().item()
    majority = torch.bincount(torch.tensor(list(test["label"]))).max().item() / len(test)
    assert results["test_majority_rate"] == pytest.approx(majority)
    assert accuracy == pytest.approx(results["test_accuracy"], abs=1.5 / len(test))  # padding may move one example
    assert accuracy > majority + 0.2
