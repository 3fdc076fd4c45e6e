"""`specrun tune` on a tiny model: it measures every shape of the ladder, the engine starts
from its profile, and a profile measured for something else is refused."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from specrun.models.loading import save_draft, save_target
from specrun.runtime import cost_profile
from specrun.runtime.config import EngineConfig, SamplingParams
from specrun.runtime.engine import Engine
from specrun.tools.cli import main
from tiny_models import random_head, random_llama, tiny_config


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A tiny target with a WordLevel tokenizer and a random EAGLE-3 head."""
    model = tmp_path_factory.mktemp("tiny-model")
    target = random_llama(tiny_config(), seed=0)
    save_target(target, model)
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(97)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(model / "tokenizer.json"))
    head = tmp_path_factory.mktemp("head")
    save_draft(random_head("eagle3", target), head)
    return model, head


def test_tune_profiles_the_ladder_and_engines_start_from_it(dirs, tmp_path, monkeypatch, capsys):
    model, head = dirs
    monkeypatch.setenv("SPECRUN_CACHE_DIR", str(tmp_path))
    argv = ["tune", "--model", str(model), "--draft", str(head), "--buckets", "1", "2"]
    assert main([*argv, "--device", "cpu", "--max-seq-len", "64", "--rounds", "2"]) == 0
    printed = capsys.readouterr().out
    [written] = list((tmp_path / "profiles").iterdir())
    profile = json.loads(written.read_text())
    assert profile["identity"]["device"] == "cpu" and profile["command"].startswith("specrun tune")
    # The default table's trees and their ladders.
    assert set(profile["milliseconds"]["1"]) == {"7,10,60", "4,5,20", "3,2,4", "plain"}
    assert set(profile["milliseconds"]["2"]) == {"6,8,48", "3,4,16", "3,2,4", "plain"}
    assert all(ms > 0 for rounds in profile["milliseconds"].values() for ms in rounds.values())
    assert "| 1 | plain |" in printed and "break-even" in printed

    config = EngineConfig(device="cpu", buckets=(1, 2), max_seq_len=64)
    engine = Engine.from_pretrained(model, draft=head, config=config)
    decoder = engine.decoder
    for variant in decoder.planner.candidates(1, [SamplingParams()]):
        want = profile["milliseconds"]["1"][variant.tag] / 1e3
        assert decoder.planner.costs.get(1, variant) == pytest.approx(want)
    engine.close()


def test_a_profile_of_another_setup_is_refused(dirs, tmp_path):
    model, head = dirs
    config = EngineConfig(device="cpu", buckets=(1,), max_seq_len=64)
    engine = Engine.from_pretrained(model, draft=head, config=config)
    profile = cost_profile.CostProfile(
        {**cost_profile.identity(engine.decoder), "device": "NVIDIA H100 80GB HBM3"},
        {1: {"plain": 1.0}},
    )
    path = tmp_path / "profile.json"
    path.write_text(profile.to_json())
    with pytest.raises(ValueError, match=r"device='NVIDIA H100 80GB HBM3'.*specrun tune"):
        cost_profile.load_into(engine.decoder, path, rebuild="specrun tune")
    path.write_text("{")
    with pytest.raises(ValueError, match="not a cost profile"):
        cost_profile.load_into(engine.decoder, path, rebuild="specrun tune")
    engine.close()


def test_artifact_profiles_are_found_per_part_and_seed_the_engine(dirs, tmp_path):
    """`specrun compile` writes a profile into each part it builds; an engine started from
    the artifacts seeds its costs from them and knows whether they cover every bucket."""
    model, head = dirs
    config = EngineConfig(device="cpu", buckets=(1, 2), max_seq_len=64, compile=False)
    built = Engine.from_pretrained(model, draft=head, config=config)
    for bucket in (1, 2):
        part = tmp_path / f"part-{bucket}"
        part.mkdir()
        (part / "manifest.json").write_text("{}")  # a part, as artifact_parts finds them
        cost_profile.save_to_artifacts(built.decoder, part, filtered=False, buckets=[bucket])
    built.close()
    served = Engine.from_pretrained(model, draft=head, config=config)
    decoder = served.decoder
    assert cost_profile.load_from_artifacts(decoder, tmp_path, rebuild="specrun compile ...")
    for bucket in (1, 2):
        profile = json.loads((tmp_path / f"part-{bucket}" / "cost_profile.json").read_text())
        assert list(profile["milliseconds"]) == [str(bucket)]
        for variant in decoder.planner.candidates(bucket, [SamplingParams()]):
            want = profile["milliseconds"][str(bucket)][variant.tag] / 1e3
            assert decoder.planner.costs.get(bucket, variant) == pytest.approx(want)
    (tmp_path / "part-2" / "cost_profile.json").unlink()
    assert not cost_profile.load_from_artifacts(decoder, tmp_path, rebuild="")
    served.close()
