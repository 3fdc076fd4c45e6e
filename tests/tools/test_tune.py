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


def _replay_eval(model, head, profile_path, json_path, *options: str) -> list[dict]:
    argv = ["eval", "--model", str(model), "--draft", str(head), "--prompts", "builtin:heldout"]
    argv += ["--max-prompts", "2", "--max-new-tokens", "6", "--ignore-eos", "--raw"]
    argv += ["--device", "cpu", "--dtype", "float32", "--temperatures", "0", "--json"]
    assert main([*argv, str(json_path), "--cost-profile", str(profile_path), *options]) == 0
    return [json.loads(line) for line in json_path.read_text().splitlines()]


def test_eval_replays_another_devices_costs(dirs, tmp_path, capsys):
    """`eval --cost-profile`: the policy decides from the profile's costs, which the rounds
    run here do not move, and each side is charged the profile's milliseconds per round."""
    model, head = dirs
    profile_path = tmp_path / "profile.json"
    argv = ["tune", "--model", str(model), "--draft", str(head), "--buckets", "1"]
    argv += ["--device", "cpu", "--dtype", "float32", "--max-seq-len", "512", "--rounds", "1"]
    assert main([*argv, "--out", str(profile_path)]) == 0
    measured = json.loads(profile_path.read_text())
    # Another device where every tree round costs a thousand plain steps.
    measured["identity"]["device"] = "NVIDIA H100 80GB HBM3"
    measured["milliseconds"]["1"] = {
        tag: 2.0 if tag == "plain" else 2000.0 for tag in measured["milliseconds"]["1"]
    }
    profile_path.write_text(json.dumps(measured))
    fixed, cost = _replay_eval(
        model, head, profile_path, tmp_path / "eval.jsonl",
        "--trees", "7,10,60", "--default-trees", "--policy", "cost",
    )  # fmt: skip
    capsys.readouterr()
    # Plain decoding: one round per token after each request's first (the prefill's).
    assert fixed["baseline_round_seconds"] == pytest.approx(2 * 5 * 2e-3)
    assert fixed["rounds_by_shape"] == {"7,10,60": fixed["num_rounds"]}
    assert fixed["round_seconds"] == pytest.approx(fixed["num_rounds"] * 2.0)
    assert fixed["speedup"] == pytest.approx(2 * 5 * 2e-3 / (fixed["num_rounds"] * 2.0))
    assert cost["rounds_by_shape"] == {"plain": 10} and cost["speedup"] == pytest.approx(1.0)


def test_tune_measures_the_stochastic_ladders_and_fixed_shapes_eval_replays(dirs, tmp_path):
    """`tune --stochastic --trees`: every bucket's sampled rounds and each given shape in
    every bucket, the rounds `eval --stochastic --default-trees --trees` runs."""
    model, head = dirs
    out = tmp_path / "profile.json"
    argv = ["tune", "--model", str(model), "--draft", str(head), "--buckets", "1", "2"]
    argv += ["--device", "cpu", "--max-seq-len", "64", "--rounds", "1", "--out", str(out)]
    assert main([*argv, "--stochastic", "--trees", "5,4,9"]) == 0
    profile = json.loads(out.read_text())
    assert {"6,8,48", "6,8,48s", "3,4,16s", "plain"} <= set(profile["milliseconds"]["2"])
    for bucket in ("1", "2"):
        assert {"5,4,9", "5,4,9s"} <= set(profile["milliseconds"][bucket])
    assert profile["command"].endswith("--stochastic --trees 5,4,9")


def test_a_replayed_profile_must_cover_the_rounds_and_match_the_model(dirs, tmp_path):
    model, head = dirs
    config = EngineConfig(device="cpu", buckets=(1,), max_seq_len=64)
    engine = Engine.from_pretrained(model, draft=head, config=config)
    own = cost_profile.identity(engine.decoder)
    greedy = [SamplingParams()]
    partial = cost_profile.CostProfile(own, {1: {"plain": 1.0, "7,10,60": 3.0}})
    with pytest.raises(ValueError, match=r"no cost for the rounds 1:3,2,4, 1:4,5,20"):
        cost_profile.replay(engine.decoder, partial, greedy)
    tags = ("plain", "7,10,60", "4,5,20", "3,2,4")
    other = cost_profile.CostProfile({**own, "model": "0123"}, {1: dict.fromkeys(tags, 1.0)})
    with pytest.raises(ValueError, match="another model"):
        cost_profile.replay(engine.decoder, other, greedy)
    # A GPU's profile: the host plans each round before reading the last one, as there.
    gpu = cost_profile.CostProfile({**own, "device": "NVIDIA H100"}, {1: dict.fromkeys(tags, 1.0)})
    cost_profile.replay(engine.decoder, gpu, greedy)
    assert engine.decoder.host_lag == 1
    whole = cost_profile.CostProfile(own, {1: dict.fromkeys(tags, 1.0)})
    cost_profile.replay(engine.decoder, whole, greedy)
    assert engine.decoder.host_lag == 0
    [plain] = [v for v in engine.decoder.planner.candidates(1, greedy) if v.tree is None]
    engine.decoder.planner.done(1, plain, 5.0, [0])
    engine.decoder.planner.done(1, plain, 5.0, [0])
    assert engine.decoder.planner.costs.get(1, plain) == pytest.approx(1e-3)
    engine.close()
