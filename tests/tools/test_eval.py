"""`specrun eval` and `specrun train-draft` end to end on a tiny model directory."""

from __future__ import annotations

import gzip
import itertools
import json
import pstats

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from specrun.models.loading import load_draft, load_target, save_draft, save_target
from specrun.runtime.config import DEFAULT_TREES, EngineConfig, SamplingParams
from specrun.runtime.distill.data import generate_sequences, load_sequences, save_sequences
from specrun.runtime.distill.trainer import (
    TrainConfig,
    expected_accepted_length,
    heldout_agreement,
    train_draft,
)
from specrun.runtime.engine import Engine
from specrun.runtime.stats import RequestStats
from specrun.runtime.tree import TreeShape
from specrun.tools.cli import main
from specrun.tools.eval import filled, measure
from specrun.tools.eval_report import category_fields
from specrun.tools.eval_stats import accepted_length, prompts_digest
from tiny_models import random_head, random_llama, tiny_config

VOCAB = 97


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny target saved as an HF directory with a WordLevel tokenizer ("t0" .. "t96")."""
    directory = tmp_path_factory.mktemp("tiny-model")
    save_target(random_llama(tiny_config(), seed=0), directory)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(directory / "tokenizer.json"))
    return directory


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    lines = [{"prompt": "t5 t17 t3"}, {"prompt_ids": [9, 41, 2, 77]}, {"prompt": "t60 t1"}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _eval_records(model_dir, prompts_file, tmp_path, *options: str) -> list[dict]:
    """`specrun eval` of a random EAGLE-3 head for the tiny model on the CPU with these
    options; its JSON lines."""
    target = random_llama(tiny_config(), seed=0)
    draft_dir = save_draft(random_head("eagle3", target, seed=1), tmp_path / "head")
    json_path = tmp_path / "eval.jsonl"
    argv = ["eval", "--model", str(model_dir), "--draft", str(draft_dir), "--prompts"]
    argv += [str(prompts_file), "--json", str(json_path), "--device", "cpu", "--dtype", "float32"]
    assert main([*argv, *options]) == 0
    return [json.loads(line) for line in json_path.read_text().splitlines()]


@pytest.mark.parametrize("stochastic", [False, True], ids=["top-k", "stochastic"])
def test_eval_reports_every_promised_field(model_dir, prompts_file, tmp_path, capsys, stochastic):
    options = ["--temperatures", "0", "1", "--max-new-tokens", "10", "--ignore-eos"]
    options += ["--depth", "3", "--topk", "2", "--nodes", "5", *["--stochastic"] * stochastic]
    records = _eval_records(model_dir, prompts_file, tmp_path, *options)
    assert [r["temperature"] for r in records] == [0.0, 1.0]
    assert [r["stochastic"] for r in records] == [stochastic] * 2
    for record in records:
        assert record["num_prompts"] == 3 and record["num_generated_tokens"] == 30
        assert len(record["accepted_histogram"]) == 4
        assert sum(record["accepted_histogram"]) == record["num_rounds"] > 0
        # Tokens the rounds could emit (accepted + bonus): each prompt's 10 but the prefill's
        # one, plus at most the depth (3) a prompt that its last round cut short.
        most = sum((a + 1) * n for a, n in enumerate(record["accepted_histogram"]))
        assert 3 * 9 <= most <= 3 * 9 + 3 * 3
        assert record["mean_accepted_length"] == pytest.approx(most / record["num_rounds"])
        assert record["tokens_per_second"] > 0 and record["baseline_tokens_per_second"] > 0
        assert record["speedup"] > 0
        for side in ("", "baseline_"):
            parts = [record[f"{side}{part}_seconds"] for part in ("prefill", "round", "other")]
            assert min(parts[:2]) > 0
            assert sum(parts) == pytest.approx(record[f"{side}wall_seconds"])
        assert record["decode_speedup"] == pytest.approx(
            record["decode_tokens_per_second"] / record["baseline_decode_tokens_per_second"]
        )
        assert record["round_ms"] == pytest.approx(
            1e3 * record["round_seconds"] / record["num_rounds"]
        )
        # Per bucket (one bucket here) and per request, the same rounds as in all.
        assert sum(record["rounds_by_bucket"].values()) == record["num_rounds"]
        assert {key.split(":", 1)[1] for key in record["rounds_by_bucket"]} == set(
            record["rounds_by_shape"]
        )
        assert len(record["requests"]) == 3
        assert sum(rounds for rounds, _ in record["requests"]) == record["num_rounds"]
        accepted = sum(a * n for a, n in enumerate(record["accepted_histogram"]))
        assert sum(drafts for _, drafts in record["requests"]) == accepted
    out = capsys.readouterr().out
    assert "accept len" in out and out.count('"temperature"') == 2
    # The table's last columns: rounds, rounds that left the drafts behind, exploring ones.
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("3,2,5")]
    assert [row[-3:] for row in rows] == [
        [str(r["num_rounds"]), str(r["num_rounds_drafts_behind"]), str(r["num_rounds_exploring"])]
        for r in records
    ]


def test_eval_compares_tree_shapes_and_plots_them(model_dir, prompts_file, tmp_path, capsys):
    png = tmp_path / "eval.png"
    options = ["--temperatures", "0", "1", "--max-new-tokens", "6", "--ignore-eos"]
    options += ["--trees", "3,2,5", "2,1,3", "--plot", str(png)]
    options += ["--policy", "cost", "--policy", "gammatune"]
    records = _eval_records(model_dir, prompts_file, tmp_path, *options)
    json_path = tmp_path / "eval.jsonl"
    points = [(r["policy"], r["depth"], r["topk"], r["nodes"], r["temperature"]) for r in records]
    sides = [("fixed", (3, 2, 5)), ("fixed", (2, 1, 3)), ("cost", (3, 2, 5))]
    sides.append(("gammatune", (3, 2, 5)))
    assert points == [
        (policy, *tree, temperature) for policy, tree in sides for temperature in (0.0, 1.0)
    ]
    assert [len(r["accepted_histogram"]) for r in records] == [4, 4, 3, 3, 4, 4, 4, 4]
    assert set(records[0]["rounds_by_shape"]) == {"3,2,5"}
    # The policies choose among the ladder of 3,2,5: smaller trees and plain decoding.
    ladder = {"3,2,5", "2,1,3", "3,2,4", "plain"}
    assert all(set(r["rounds_by_shape"]) <= ladder for r in records[4:])
    # One plain baseline per temperature, shared by every shape.
    for first, second in ((0, 2), (1, 3), (0, 4)):
        assert records[first]["baseline_wall_seconds"] == records[second]["baseline_wall_seconds"]
    out = capsys.readouterr().out
    assert "    3,2,5" in out and "cost 3,2,5" in out
    # Each later side paired with the first at both temperatures.
    assert "accepted length against 3,2,5 (base), paired by prompt" in out
    assert out.count(" 2,1,3 ") >= 2 and "gammatune 3,2,5" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = tmp_path / "again.png"
    assert main(["eval-plot", str(json_path), str(json_path), "--out", str(again)]) == 0
    assert again.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("trees", [["5,8"], ["5,8,x"], ["5,0,8"], ["2,1,9"]])
def test_eval_refuses_a_malformed_tree(trees, capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--draft", "d", "--prompts", "p", "--trees", *trees])
    assert "--trees" in capsys.readouterr().err


def test_eval_refuses_trees_with_a_single_shape(capsys):
    argv = ["eval", "--draft", "d", "--prompts", "p", "--trees", "5,8,32", "--depth", "4"]
    assert main(argv) == 2
    assert "either --trees or --depth" in capsys.readouterr().err


def test_train_draft_writes_a_head_the_engine_loads(model_dir, prompts_file, tmp_path, capsys):
    out = tmp_path / "trained"
    argv = ["train-draft", "--model", str(model_dir), "--out", str(out), "--prompts"]
    argv += [str(prompts_file), "--steps", "4", "--batch-size", "2", "--ttt-steps", "2"]
    argv += ["--draft-vocab", "40", "--max-new-tokens", "12", "--heldout", "1"]
    argv += ["--device", "cpu", "--dtype", "float32", "--checkpoint-interval", "2"]
    assert main(argv) == 0
    assert "held-out top-1 agreement" in capsys.readouterr().out
    assert (out / "checkpoint" / "state.pt").is_file()
    assert main([*argv, "--steps", "6", "--resume"]) == 0
    state = torch.load(out / "checkpoint" / "state.pt", weights_only=True)
    assert state["step"] == 6
    tuned = tmp_path / "tuned"
    argv_tuned = [a if a != str(out) else str(tuned) for a in argv]
    assert main([*argv_tuned, "--steps", "2", "--init-from", str(out)]) == 0
    assert (tuned / "config.json").read_text() == (out / "config.json").read_text()
    config = EngineConfig(device="cpu", dtype="float32")
    spec = Engine.from_pretrained(model_dir, draft=out, config=config)
    plain = Engine.from_pretrained(model_dir, config=config)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    assert spec.generate("t5 t17 t3", params)[0].token_ids == (
        plain.generate("t5 t17 t3", params)[0].token_ids
    )


def test_train_draft_trains_a_two_layer_eagle3_head(model_dir, prompts_file, tmp_path):
    out = tmp_path / "two-layers"
    argv = ["train-draft", "--model", str(model_dir), "--out", str(out), "--prompts"]
    argv += [str(prompts_file), "--kind", "eagle3", "--num-layers", "2", "--steps", "2"]
    argv += ["--batch-size", "2", "--ttt-steps", "2", "--draft-vocab", "40", "--heldout", "1"]
    argv += ["--max-new-tokens", "8", "--device", "cpu", "--dtype", "float32"]
    assert main(argv) == 0
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    config = EngineConfig(device="cpu", dtype="float32")
    spec = Engine.from_pretrained(model_dir, draft=out, config=config)
    plain = Engine.from_pretrained(model_dir, config=config)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    assert spec.generate("t60 t1", params)[0].token_ids == (
        plain.generate("t60 t1", params)[0].token_ids
    )


def test_train_draft_reuses_sequences_an_earlier_run_wrote(model_dir, prompts_file, tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    argv = ["train-draft", "--model", str(model_dir), "--steps", "2", "--batch-size", "2"]
    argv += ["--ttt-steps", "2", "--draft-vocab", "40", "--heldout", "1", "--max-new-tokens", "8"]
    argv += ["--device", "cpu", "--dtype", "float32"]
    assert main([*argv, "--out", str(first), "--prompts", str(prompts_file)]) == 0
    written = first / "checkpoint" / "sequences.jsonl"
    packed = tmp_path / "sequences.jsonl.gz"
    packed.write_bytes(gzip.compress(written.read_bytes()))
    assert main([*argv, "--out", str(second), "--sequences", str(packed)]) == 0
    assert (second / "checkpoint" / "sequences.jsonl").read_bytes() == written.read_bytes()
    assert main([*argv, "--out", str(second)]) == 2  # neither prompts nor sequences


def test_train_draft_generates_only_then_trains_on_what_it_wrote(model_dir, prompts_file, tmp_path):
    data, head = tmp_path / "data", tmp_path / "head"
    argv = ["train-draft", "--model", str(model_dir), "--max-new-tokens", "8"]
    argv += ["--device", "cpu", "--dtype", "float32"]
    assert main([*argv, "--out", str(data), "--prompts", str(prompts_file), "--generate-only"]) == 0
    assert sorted(p.name for p in data.iterdir()) == ["sequences.jsonl.gz"]
    sequences = load_sequences(data / "sequences.jsonl.gz")
    num_prompts = len(prompts_file.read_text().splitlines())
    assert len(sequences) == num_prompts
    assert all(len(s.token_ids) > s.num_prompt for s in sequences)
    train = ["--steps", "2", "--batch-size", "2", "--ttt-steps", "2", "--draft-vocab", "40"]
    train += ["--heldout", "1", "--out", str(head), "--sequences", str(data / "sequences.jsonl.gz")]
    assert main([*argv, *train]) == 0
    assert load_sequences(head / "checkpoint" / "sequences.jsonl") == sequences
    assert main([*argv, "--out", str(data), "--sequences", str(head), "--generate-only"]) == 2


def test_train_draft_measures_a_given_heldout_set_and_keeps_it_on_resume(
    model_dir, prompts_file, tmp_path, capsys
):
    data, head, tuned = tmp_path / "data", tmp_path / "head", tmp_path / "tuned"
    argv = ["train-draft", "--model", str(model_dir), "--max-new-tokens", "8"]
    argv += ["--device", "cpu", "--dtype", "float32"]
    assert main([*argv, "--out", str(data), "--prompts", str(prompts_file), "--generate-only"]) == 0
    written = str(data / "sequences.jsonl.gz")
    argv += ["--batch-size", "2", "--ttt-steps", "2", "--draft-vocab", "40", "--heldout", "2"]
    argv += ["--length-groups", "2"]
    train = ["--sequences", written, "--heldout-sequences", written]
    assert main([*argv, *train, "--steps", "4", "--stop-at", "2", "--out", str(head)]) == 0
    kept = load_sequences(head / "checkpoint" / "heldout.jsonl")
    assert kept == load_sequences(written)[:2]
    capsys.readouterr()
    assert main([*argv, *train, "--steps", "2", "--out", str(tuned), "--init-from", str(head)]) == 0
    printed = capsys.readouterr().out
    assert "agreement per draft step at step 0:" in printed
    assert "agreement per draft step at step 2:" in printed
    resume = [*argv, "--out", str(head), "--steps", "4", "--resume"]
    assert main([*resume, "--heldout-sequences", written]) == 2
    capsys.readouterr()
    assert main(resume) == 0
    resumed = capsys.readouterr().out.splitlines()[-2]
    # The resumed run trains on every sequence and measures the kept set, as a whole run does.
    assert main([*argv, *train, "--steps", "4", "--out", str(tmp_path / "whole")]) == 0
    assert capsys.readouterr().out.splitlines()[-2] == resumed
    states = [torch.load(out / "checkpoint" / "state.pt", weights_only=True)
              for out in (head, tmp_path / "whole")]  # fmt: skip
    assert states[0]["config"]["length_groups"] == 2
    for name, tensor in states[0]["head"].items():
        assert torch.equal(tensor, states[1]["head"][name]), name


def test_eval_measures_a_head_on_fixed_sequences(model_dir, tmp_path, capsys):
    """`eval --sequences`: the head's teacher-forced agreement on the first --max-prompts
    sequences, as training's held-out estimate computes it, and the chain length it implies."""
    target = load_target(model_dir, dtype=torch.float32, device="cpu")
    generator = torch.Generator().manual_seed(2)
    prompts = [torch.randint(VOCAB, (3 + i % 4,), generator=generator).tolist() for i in range(40)]
    sequences = generate_sequences(target, prompts, max_new_tokens=16, temperature=0.0)
    # A head trained a little, so that its agreement is far from zero.
    head_dir = tmp_path / "head"
    config = TrainConfig(num_steps=30, lr=3e-3, num_ttt_steps=3, num_heldout=0, draft_vocab_size=48)
    train_draft(target, sequences, config=config, out_dir=head_dir, progress=False)
    path = tmp_path / "fixed.jsonl.gz"
    save_sequences(sequences, path)
    json_path = tmp_path / "agreement.jsonl"
    argv = ["eval", "--model", str(model_dir), "--draft", str(head_dir), "--sequences", str(path)]
    argv += ["--max-prompts", "9", "--json", str(json_path), "--device", "cpu"]
    assert main([*argv, "--dtype", "float32"]) == 0
    (record,) = [json.loads(line) for line in json_path.read_text().splitlines()]
    head = load_draft(head_dir, target=target).float()
    config = TrainConfig(batch_size=8, max_length=512, num_ttt_steps=7)
    expected = heldout_agreement(head, target, sequences[:9], config=config)
    assert record["num_sequences"] == 9 and record["agreement"] == expected
    assert record["chain_length"] == pytest.approx(expected_accepted_length(expected))
    assert record["agreement"][0] > 0.3
    assert f"{record['chain_length']:.3f}" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # --prompts or --sequences, not both
        main([*argv, "--prompts", "builtin:broad"])


def test_bench_cold_start_reports_a_fresh_process(model_dir, tmp_path, capsys):
    # One jit point of a tiny model on the CPU: the fields BENCHMARKS.md's table is made of.
    out = tmp_path / "cold.jsonl"
    argv = ["bench", "cold-start", "--model", str(model_dir), "--modes", "jit"]
    argv += ["--device", "cpu", "--dtype", "float32", "--max-seq-len", "64", "--prompt-len", "9"]
    argv += ["--profile", str(tmp_path / "profile")]
    assert main([*argv, "--timeout", "600", "--json", str(out)]) == 0
    (point,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert "error" not in point, point
    marks = ["import_s", "weights_s", "warmup_s", "first_token_s", "first_round_s"]
    assert all(point[a] <= point[b] for a, b in itertools.pairwise(marks))
    assert point["next_request_token_s"] > 0 and point["dynamo_graphs"] > 0
    assert 0 < point["bucket_prepare_s"]["1:plain"] <= point["warmup_s"]
    stats = pstats.Stats(str(tmp_path / "profile" / "cold-jit-0-warmup.pstats"))
    assert any(name == "warmup" for _, _, name in stats.stats)


def test_eval_measures_each_batch_size(model_dir, prompts_file, tmp_path):
    """--batch-sizes: one point per batch size, the prompts repeated to fill a batch larger
    than their number, each against plain decoding at the same batch size."""
    options = ["--temperatures", "0", "--max-new-tokens", "10", "--ignore-eos"]
    options += ["--trees", "3,2,5", "--batch-sizes", "4", "1"]
    records = _eval_records(model_dir, prompts_file, tmp_path, *options)
    assert [(r["batch_size"], r["num_prompts"]) for r in records] == [(1, 3), (4, 4)]
    assert [r["num_generated_tokens"] for r in records] == [30, 40]
    assert records[0]["baseline_wall_seconds"] != records[1]["baseline_wall_seconds"]


def test_eval_keeps_the_points_measured_before_a_run_is_cut_short(
    model_dir, prompts_file, tmp_path, monkeypatch
):
    """Each point's JSON line is in the --json file as soon as it is measured: a run that
    stops at its second tree keeps the first tree's points."""
    from specrun.tools import eval as eval_tool

    calls = []

    def measure_or_stop(*args, **kwargs):
        calls.append(args[0])
        if len(set(calls)) == 3:  # the plain engine, the first tree's, the second tree's
            raise KeyboardInterrupt
        return measure(*args, **kwargs)

    monkeypatch.setattr(eval_tool, "measure", measure_or_stop)
    options = ["--temperatures", "0", "--max-new-tokens", "4", "--trees", "3,2,5", "2,2,3"]
    with pytest.raises(KeyboardInterrupt):
        _eval_records(model_dir, prompts_file, tmp_path, *options)
    records = [json.loads(line) for line in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [(r["depth"], r["topk"], r["nodes"]) for r in records] == [(3, 2, 5)]


def test_eval_repeats_every_point(model_dir, prompts_file, tmp_path):
    """--repeats: each point decodes its prompts that many times and reports the totals, each
    pass's requests in prompt order (greedy: the same rounds every pass)."""
    options = ["--temperatures", "0", "--max-new-tokens", "10", "--ignore-eos"]
    options += ["--trees", "3,2,5", "--batch-sizes", "4", "--repeats", "2"]
    [record] = _eval_records(model_dir, prompts_file, tmp_path, *options)
    assert (record["repeats"], record["num_prompts"]) == (2, 4)
    assert record["num_generated_tokens"] == 2 * 4 * 10
    requests = record["requests"]
    assert len(requests) == 8 and requests[:4] == requests[4:]
    assert sum(rounds for rounds, _ in requests) == sum(record["accepted_histogram"])


def test_eval_measures_plain_decoding_against_itself_on_request(model_dir, prompts_file, tmp_path):
    """--plain-floor: every point also holds a second plain engine's tokens/s over the
    first's (absent without it)."""
    options = ["--temperatures", "0", "--max-new-tokens", "6", "--ignore-eos"]
    options += ["--trees", "3,2,5", "--batch-sizes", "1", "2"]
    plain = _eval_records(model_dir, prompts_file, tmp_path, *options)
    assert all("plain_floor" not in record for record in plain)
    floored = _eval_records(model_dir, prompts_file, tmp_path, *options, "--plain-floor")
    assert len(floored) == 2 and all(record["plain_floor"] > 0 for record in floored)


def test_eval_refuses_fewer_than_one_repeat(capsys):
    argv = ["eval", "--draft", "d", "--prompts", "p", "--trees", "5,8,32", "--repeats", "0"]
    assert main(argv) == 2
    assert "--repeats must be at least 1" in capsys.readouterr().err


def test_eval_policies_can_choose_among_the_default_trees(model_dir, prompts_file, tmp_path):
    """--default-trees: the policy side runs the engine's default table, a tree per batch
    size (each its ladder's top); the fixed side keeps --trees."""
    options = ["--temperatures", "0", "--max-new-tokens", "6", "--trees", "3,2,5"]
    options += ["--batch-sizes", "1", "4", "--policy", "cost", "--default-trees"]
    records = _eval_records(model_dir, prompts_file, tmp_path, *options)
    shapes = {(r["policy"], r["batch_size"]): (r["depth"], r["topk"], r["nodes"]) for r in records}
    default = {b: DEFAULT_TREES[b] for b in (1, 4)}
    assert shapes == {
        ("fixed", 1): (3, 2, 5),
        ("fixed", 4): (3, 2, 5),
        **{("cost", b): (t.depth, t.topk, t.num_nodes) for b, t in default.items()},
    }
    # The policy's costs when each point ended: every round it ran among them, in ms.
    for record in records:
        if record["policy"] == "fixed":
            assert "policy_round_ms" not in record
            continue
        costs = record["policy_round_ms"]
        assert set(record["rounds_by_bucket"]) <= set(costs)
        assert all(0 < ms < 60_000 for ms in costs.values())


def test_category_fields_pool_each_category_over_its_rounds():
    per_request = [RequestStats(4, 6), RequestStats(2, 0), RequestStats(3, 3), RequestStats(5, 1)]
    fields = category_fields(["math", None, "math", "coding"], per_request, [0, 1, 2, 3])
    math_error = accepted_length([[4, 6], [3, 3]], [0, 2]).stderr
    assert fields == {
        "accepted_length_by_category": {"coding": 6 / 5, "math": (6 + 3 + 4 + 3) / (4 + 3)},
        "accepted_length_stderr_by_category": {"coding": None, "math": math_error},
        "rounds_by_category": {"coding": 5, "math": 7},
        "requests_by_category": {"coding": 1, "math": 2},
    }
    assert math_error > 0
    # A prompt repeated within its category is one prompt: one value, no error.
    repeated = category_fields(["math", "math"], per_request[:2], [0, 0])
    assert repeated["accepted_length_stderr_by_category"] == {"math": None}
    assert category_fields([None, None], per_request[:2], [0, 1]) == {}
    assert filled(["a", "b", "c"], 4) == ["a", "b", "c", "a"] and filled(["a"], 1) == ["a"]


def test_eval_reports_accepted_length_per_category(model_dir, tmp_path, capsys):
    """Categorised prompts: per-category lengths, rounds and requests in each point; pooled
    together they are the point's own mean accepted length; a table per category follows."""
    path = tmp_path / "categorised.jsonl"
    lines = [{"prompt": "t5 t17 t3", "category": "math"}, {"prompt": "t60 t1", "category": "stem"}]
    lines.append({"prompt_ids": [9, 41, 2, 77], "category": "math"})
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    options = ["--temperatures", "0", "1", "--max-new-tokens", "8", "--ignore-eos"]
    options += ["--trees", "3,2,5", "--batch-sizes", "1", "2"]
    records = _eval_records(model_dir, path, tmp_path, *options)
    points = [(r["temperature"], r["batch_size"]) for r in records]
    assert points == [(0, 1), (0, 2), (1, 1), (1, 2)]
    for record in records:
        assert record["requests_by_category"] == {"math": 2, "stem": 1}
        assert record["request_categories"] == ["math", "stem", "math"]
        lengths, rounds = record["accepted_length_by_category"], record["rounds_by_category"]
        assert sum(rounds.values()) == sum(record["accepted_histogram"])
        pooled = sum(lengths[c] * rounds[c] for c in rounds) / sum(rounds.values())
        assert pooled == pytest.approx(record["mean_accepted_length"])
    out = capsys.readouterr().out
    assert "accepted length (tokens per round) by category, +-95%" in out
    assert out.count(" math ") == 1 and out.count(" stem") == 1


def test_measure_returns_each_requests_stats_in_prompt_order(model_dir, tmp_path):
    target = random_llama(tiny_config(), seed=0)
    draft_dir = save_draft(random_head("eagle3", target, seed=1), tmp_path / "head")
    config = EngineConfig(device="cpu", dtype="float32", buckets=(1,), compile=False,
                          trees={1: TreeShape(3, 2, 5)})  # fmt: skip
    engine = Engine.from_pretrained(model_dir, draft=draft_dir, config=config)
    prompts = ["t5 t17 t3", [9, 41, 2, 77, 30, 30], "t60 t1"]
    # The first prompt's fifth token stops every request, so requests run different rounds.
    first = engine.generate(prompts[0], SamplingParams(max_new_tokens=12, ignore_eos=True))
    params = SamplingParams(max_new_tokens=12, ignore_eos=True,
                            stop_token_ids=(first[0].token_ids[4],))  # fmt: skip
    stats, per_request = measure(engine, prompts, params)
    alone = [engine.generate(prompt, params)[0].stats for prompt in prompts]
    assert per_request == alone and len(set(per_request)) > 1
    assert sum(s.num_rounds for s in per_request) == stats.num_rounds


def test_train_draft_answers_built_in_prompts_at_mixed_temperatures(model_dir, tmp_path, capsys):
    argv = ["train-draft", "--model", str(model_dir), "--out", str(tmp_path / "head")]
    argv += ["--prompts", "builtin:train-broad", "--max-prompts", "3", "--steps", "1"]
    argv += ["--batch-size", "2", "--ttt-steps", "1", "--draft-vocab", "40", "--heldout", "0"]
    argv += ["--max-new-tokens", "4", "--device", "cpu", "--dtype", "float32"]
    assert main([*argv, "--temperature", "1", "--response-temperatures", "0", "1"]) == 2
    assert "not both" in capsys.readouterr().err
    assert main([*argv, "--response-temperatures", "0", "1"]) == 0
    assert "temperatures [0.0, 1.0]" in capsys.readouterr().out
    written = tmp_path / "head" / "checkpoint" / "sequences.jsonl"
    assert len(written.read_text().splitlines()) == 3  # no chat template: no follow-ups


def test_eval_compare_pairs_two_runs_by_prompt(model_dir, prompts_file, tmp_path, capsys):
    """Each point of `specrun eval` carries its error, its requests' prompts and the prompts'
    digest; `--compare` of two runs over the same prompts (batch 4 fills with a repeated
    prompt) prints the paired difference, zero for a run against itself."""
    options = ["--temperatures", "0", "--max-new-tokens", "8", "--ignore-eos"]
    options += ["--trees", "3,2,5", "--batch-sizes", "4"]
    [record] = _eval_records(model_dir, prompts_file, tmp_path, *options)
    assert record["request_prompts"] == [0, 1, 2, 0] and "request_categories" not in record
    assert record["prompts_digest"] == prompts_digest(["t5 t17 t3", [9, 41, 2, 77], "t60 t1"])
    expected = accepted_length(record["requests"], record["request_prompts"])
    assert record["accepted_length_stderr"] == pytest.approx(expected.stderr)
    assert expected.value == pytest.approx(record["mean_accepted_length"])
    base = tmp_path / "base.jsonl"
    base.write_text(json.dumps(record) + "\n")
    capsys.readouterr()
    assert main(["eval", "--compare", str(base), str(tmp_path / "eval.jsonl")]) == 0
    [row] = [line.split() for line in capsys.readouterr().out.splitlines() if "3,2,5" in line]
    assert row[3:] == ["3", f"{expected.value:.3f}", f"{expected.value:.3f}", "+0.000", "0.000"]
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({**record, "prompts_digest": "x"}) + "\n")
    assert main(["eval", "--compare", str(base), str(other)]) == 2
    assert "different prompts" in capsys.readouterr().err


def test_eval_needs_a_head_to_decode(capsys):
    assert main(["eval", "--prompts", "p"]) == 2
    assert "--draft is required" in capsys.readouterr().err


def test_eval_measures_the_head_alone_without_plain_decoding(
    model_dir, prompts_file, tmp_path, capsys
):
    """--no-plain: the same accepted lengths and rounds as a run with plain decoding, no
    plain or speed-up fields, '-' in their columns; refused beside --plain-floor."""
    options = ["--temperatures", "0", "--max-new-tokens", "8", "--ignore-eos", "--trees", "3,2,5"]
    [full] = _eval_records(model_dir, prompts_file, tmp_path, *options)
    [alone] = _eval_records(model_dir, prompts_file, tmp_path, *options, "--no-plain")
    assert alone["requests"] == full["requests"]
    assert alone["mean_accepted_length"] == full["mean_accepted_length"]
    assert alone["accepted_length_stderr"] == full["accepted_length_stderr"]
    plain_fields = {key for key in full if key.startswith("baseline_") or "speedup" in key}
    assert plain_fields and not plain_fields & set(alone)
    [row] = [line.split() for line in capsys.readouterr().out.splitlines()[-1:]]
    # plain tok/s, speedup, step ms and decode speedup; the round's ms stays
    assert [row[i] for i in (6, 7, 9, 10)] == ["-"] * 4 and float(row[8]) > 0
    assert main(["eval", "--draft", "d", "--prompts", "p", "--no-plain", "--plain-floor"]) == 2
    assert "leave out --no-plain" in capsys.readouterr().err
