"""`specrun check`: with the embedded model it checks the shipped head with the head's own
trees; with another model it needs `--draft`."""

from __future__ import annotations

import json

from specrun.tools.cli import main


def test_check_uses_the_shipped_head_and_its_trees(smollm_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPECRUN_CACHE_DIR", str(smollm_dir.parent))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "What is 7 * 8?"}) + "\n")
    argv = ["check", "--prompts", str(prompts), "--max-new-tokens", "8", "--device", "cpu"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "1/1 prompts identical" in out
    # The head's trees.json gives batch 1 the (6, 8, 63) tree, not the engine default.
    assert "depth=6, topk=8, num_nodes=63" in out


def test_check_of_another_model_needs_a_draft(tmp_path, capsys):
    assert main(["check", "--model", str(tmp_path), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specrun check: error: --draft is needed") and "\n" not in err
