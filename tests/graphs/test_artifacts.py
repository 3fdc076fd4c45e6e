"""Ahead-of-time compile artifacts: runtime/graphs/artifacts.py, runtime/aot.py, `specrun compile`.

A tiny model's steps are compiled to artifacts in one process and loaded in a fresh one
(artifacts_child.py) whose Inductor cache holds nothing compiled: the loading process decodes
exactly what the compiling process decoded with its JIT-compiled steps, compiles nothing with
Inductor (every FX graph is a cache hit) and runs every round from the precompiled steps
(no Dynamo trace). Artifacts built for another torch, device, dtype, model or table, and
damaged ones, are refused with a ValueError naming what differs and how to rebuild.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from graphs.artifacts_child import decode, prompts

from specrun.models.loading import load_draft, load_target, save_draft, save_target
from specrun.runtime import aot, cost_profile
from specrun.runtime.config import EngineConfig, SamplingParams, default_trees, stochastic_trees
from specrun.runtime.decoder import Decoder
from specrun.runtime.engine import Engine
from specrun.runtime.graphs import artifacts
from specrun.runtime.tree import TreeShape
from specrun.tools import cli
from specrun.tools import compile as compile_tool
from tiny_models import random_head, random_llama, tiny_config

CHILD = Path(__file__).with_name("artifacts_child.py")
# What the `built` fixture builds: artifacts_child.py with a head, bucket 2 and a stochastic
# tree.
CONFIG = EngineConfig(
    device="cpu",
    dtype="float32",
    buckets=(2,),
    trees={1: TreeShape(2, 2, 4, stochastic=True)},
    max_seq_len=64,
    compile=True,
    policy="fixed",
)


def run_child(mode: str, root: Path, *extra: str, cache: Path) -> dict:
    """Run artifacts_child.py in a fresh process with its own Inductor cache directory."""
    command = [sys.executable, str(CHILD), mode, "--model", str(root / "model")]
    command += ["--out", str(root / "artifacts"), *extra]
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-6000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def jit_compiles(report: dict) -> dict[str, int]:
    """The steps a child compiled on demand (not ahead of time), with their graph counts."""
    return {name: s["compiles"] for name, s in report["steps"].items() if s["compiles"]}


def greedy_outputs(report: dict) -> list:
    """A build report's greedy outputs, one per bucket: greedy decoding comes first among
    each bucket's sampling parameters."""
    num_variants = len(report["outputs"]) // len(report["eager_greedy_outputs"])
    return report["outputs"][::num_variants]


def precompiled_calls(report: dict) -> int:
    return sum(step["precompiled_calls"] for step in report["steps"].values())


def build_args(root: Path) -> list[str]:
    return ["--draft", str(root / "head"), "--buckets", "2", "--stochastic"]


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, Path, dict]:
    """(root with model/, head/ and artifacts/, the Inductor cache the children share, the
    compiling process's report): a one-layer target with an EAGLE-3 head, bucket 2 (the
    target's and the draft's prefill graphs for batches over 1: the batch-1 graphs load as
    `test_compile_jobs_build_parts_that_load_together` shows), a stochastic tree, and rounds
    for greedy and for sampling requests. The build
    compiles into a private directory, so the shared cache holds only Inductor's CPU probes,
    never a compiled graph."""
    root = tmp_path_factory.mktemp("aot")
    target = random_llama(tiny_config(num_layers=1))
    save_target(target, root / "model")
    save_draft(random_head("eagle3", target), root / "head")
    cache = root / "inductor-cache"
    return root, cache, run_child("build", root, *build_args(root), cache=cache)


def test_a_fresh_process_decodes_like_the_build_and_eager_without_tracing(built):
    root, cache, build = built
    assert not (cache / "fxgraph").exists(), "the build must not compile into the shared cache"
    loaded = run_child("load", root, *build_args(root), cache=cache)
    assert loaded["outputs"] == build["outputs"]
    assert greedy_outputs(build) == build["eager_greedy_outputs"]
    assert build["counters"]["dynamo_graphs"] > 0
    # The build compiles each graph once, ahead of time, and its warm-up runs that.
    assert jit_compiles(build) == {} and precompiled_calls(build) > 0
    counters = loaded["counters"]
    # Nothing is traced (every step, the dynamic prefill included, is precompiled), lowered
    # or compiled: the artifacts' Triton/C++ kernels come from the mega-cache.
    assert counters["dynamo_graphs"] == 0 and counters["fxgraph_cache_miss"] == 0
    assert jit_compiles(loaded) == {}
    assert {name for name, s in loaded["steps"].items() if s["precompiled_calls"]} == {
        "round",
        "prefill_target",
        "prefill_draft",
    }


def test_the_manifest_records_what_was_built(built):
    root, _, _ = built
    manifest = artifacts.read_manifest(root / "artifacts", rebuild="")
    assert manifest.torch == torch.__version__ and manifest.device == "cpu"
    assert manifest.dtype == "float32" and manifest.buckets == (2,)
    assert manifest.trees == (repr(CONFIG.tree_for(2)),) and manifest.head is not None
    # The prefill graphs of the target and the head; rounds for greedy and sampling batches.
    assert manifest.precompiled == ("prefill_draft-0", "prefill_target-0", "round-0", "round-1")
    names = {name for name, _ in manifest.files}
    assert {"compile_cache.bin", "cpu_kernels.zip", "steps/round-1.bin"} <= names
    artifacts.check_files(root / "artifacts", manifest, rebuild="")


def _decoder(
    root: Path, config: EngineConfig = CONFIG, *, head: bool = True, **model_overrides
) -> Decoder:
    """A decoder of root's model (and head), or of a random target whose config differs by
    `model_overrides` (with a random head)."""
    if model_overrides:
        target = random_llama(tiny_config(num_layers=1, **model_overrides))
        return Decoder(target, random_head("eagle3", target), config)
    target = load_target(root / "model", dtype=config.resolved_dtype(), device="cpu")
    return Decoder(target, load_draft(root / "head", target=target) if head else None, config)


def _copy(built, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(built[0] / "artifacts", copy)
    return copy


def test_artifacts_for_another_torch_are_refused_with_the_rebuild_command(built, tmp_path):
    copy = _copy(built, tmp_path)
    manifest = json.loads((copy / "manifest.json").read_text())
    (copy / "manifest.json").write_text(json.dumps(manifest | {"torch": "0.0.0"}))
    rebuild = "specrun compile --model m --out x"
    expected = (
        f"artifacts in {copy} were built for torch='0.0.0' but this process has "
        f"'{torch.__version__}'; rebuild with `{rebuild}`"
    )
    with pytest.raises(ValueError) as error:
        aot.load_into(_decoder(built[0]), copy, rebuild=rebuild)
    assert str(error.value) == expected


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"buckets": (1, 2)}, "buckets=(2,) but this process has (1, 2)"),
        ({"dtype": "bfloat16"}, "dtype='float32' but this process has 'bfloat16'"),
        ({"max_seq_len": 96}, "max_seq_len=64 but this process has 96"),
        ({"model": {"hidden_size": 48}}, "model="),
    ],
)
def test_artifacts_for_another_setup_are_refused(built, change, message):
    change = dict(change)
    model = change.pop("model", None)
    config = dataclasses.replace(CONFIG, **change)
    decoder = _decoder(built[0], config, **(model or {}))
    with pytest.raises(ValueError, match="were built for") as error:
        aot.load_into(decoder, built[0] / "artifacts", rebuild="specrun compile ...")
    assert message in str(error.value) and "rebuild with `specrun compile ...`" in str(error.value)


def test_damaged_or_missing_artifacts_are_refused(built, tmp_path):
    copy = _copy(built, tmp_path)
    data = bytearray((copy / "compile_cache.bin").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (copy / "compile_cache.bin").write_bytes(bytes(data))
    decoder = _decoder(built[0])
    with pytest.raises(ValueError, match=r"are damaged: compile_cache.bin .* rebuild with `x`"):
        aot.load_into(decoder, copy, rebuild="x")
    with pytest.raises(ValueError, match=r"holds no specrun artifacts .* rebuild with `x`"):
        aot.load_into(decoder, tmp_path / "nothing", rebuild="x")
    (copy / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="unreadable manifest"):
        aot.load_into(decoder, copy, rebuild="x")


def test_compile_command_is_idempotent(built, capsys):
    root, _, _ = built
    args = ["compile", "--model", str(root / "model"), "--out", str(root / "artifacts")]
    args += ["--device", "cpu", "--dtype", "float32", "--tree", "2", "2", "4"]
    args += ["--max-seq-len", "64", "--skip-filtered", "--policy", "fixed", *build_args(root)]
    assert cli.main(args) == 0
    assert "is up to date" in capsys.readouterr().out


def test_save_replaces_the_directory_whole(tmp_path, monkeypatch):
    """A second save swaps in a complete new directory and leaves no staging directory."""
    payloads = iter([b"first", b"second"])
    monkeypatch.setattr(torch.compiler, "save_cache_artifacts", lambda: (next(payloads), None))
    manifest = artifacts.current_manifest(
        device=torch.device("cpu"), dtype=torch.float32, model=("m",), head=None,
        buckets=(1,), trees=((None,),), max_seq_len=8, cuda_graphs=False,
    )  # fmt: skip
    out = tmp_path / "out"
    for payload in (b"first", b"second"):
        with artifacts.recording() as recording:
            written = artifacts.save(recording, out, manifest)
        artifacts.check_files(out, written, rebuild="")
        assert (out / "compile_cache.bin").read_bytes() == payload
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    assert artifacts.is_up_to_date(out, manifest)
    assert not artifacts.is_up_to_date(out, dataclasses.replace(manifest, dtype="x"))


def test_engine_refuses_artifacts_with_compilation_off(tmp_path):
    config = EngineConfig(device="cpu", compile=False)
    with pytest.raises(ValueError, match="compile=True"):
        Engine.from_pretrained(tmp_path, config=config, artifacts=tmp_path)


def test_compile_command_renders_the_engine_config(tmp_path):
    config = EngineConfig(buckets=(1, 2), trees={1: TreeShape(2, 2, 4)}, max_seq_len=128)
    command = aot.compile_command(model_dir="m", draft="d", config=config, out="o")
    assert command == (
        "specrun compile --model m --draft d --buckets 1 2 --max-seq-len 128 --device auto "
        "--dtype auto --tree 2 2 4 --out o"
    )
    # A head's own trees (trees.json) are what `specrun compile --draft` uses by default.
    head = tmp_path / "head"
    head.mkdir()
    (head / "trees.json").write_text('{"trees": {"1": [2, 2, 4]}}')
    config = EngineConfig(buckets=(1, 2), trees=default_trees(head), max_seq_len=128)
    command = aot.compile_command(model_dir="m", draft=head, config=config, out="o")
    assert "--tree" not in command and "with this EngineConfig" not in command


@pytest.mark.parametrize(
    "trees",
    [
        {1: TreeShape(2, 2, 4)},
        {1: TreeShape(2, 2, 4, stochastic=True)},
        "head",
        "head, stochastic",
    ],
)
def test_the_compile_command_builds_for_the_same_trees(tmp_path, trees):
    """`specrun compile` run with the rendered command compiles for the engine's trees,
    stochastic ones included."""
    head = tmp_path / "head"
    head.mkdir()
    (head / "trees.json").write_text('{"trees": {"1": [2, 2, 4]}}')
    if isinstance(trees, str):
        table = default_trees(head)
        trees = stochastic_trees(table) if trees.endswith("stochastic") else table
    config = EngineConfig(buckets=(1, 2), trees=trees, max_seq_len=128)
    command = aot.compile_command(model_dir="m", draft=head, config=config, out="o")
    args = cli.build_parser().parse_args(shlex.split(command)[1:])
    assert compile_tool.engine_config(args).trees == config.trees
    for policy in ("cost", "ema"):
        config = dataclasses.replace(config, policy=policy)
        command = aot.compile_command(model_dir="m", draft=head, config=config, out="o")
        args = cli.build_parser().parse_args(shlex.split(command)[1:])
        assert compile_tool.engine_config(args).policy == policy


@pytest.mark.gpu
def test_gpu_engine_starts_from_artifacts_in_a_fresh_process(smollm_dir, tmp_path):
    """The embedded model with a random EAGLE-3 head, bf16, CUDA graphs, two buckets, a
    stochastic tree and every round variant (greedy, sampled, top-k/top-p; the rejection-walk
    kernel included): built in one process, served by Engine.from_pretrained(artifacts=...)
    in another, token for token the same."""
    from specrun.models.loading import save_draft
    from tiny_models import random_head

    target = load_target(smollm_dir, dtype=torch.float32, device="cpu")
    save_draft(random_head("eagle3", target), tmp_path / "head")
    (tmp_path / "model").symlink_to(smollm_dir)
    extra = ["--draft", str(tmp_path / "head"), "--device", "cuda", "--dtype", "bfloat16"]
    extra += ["--buckets", "1", "2", "--tree", "3", "4", "8", "--max-seq-len", "256"]
    extra += ["--stochastic", "--filtered"]
    cache = tmp_path / "inductor-cache"
    build = run_child("build", tmp_path, *extra, cache=cache)
    assert not (cache / "fxgraph").exists()
    loaded = run_child("load", tmp_path, *extra, "--engine", cache=cache)
    assert loaded["outputs"] == build["outputs"]
    assert loaded["counters"]["dynamo_graphs"] == 0
    assert loaded["counters"]["fxgraph_cache_miss"] == 0
    assert jit_compiles(loaded) == {} and precompiled_calls(loaded) > 0


def test_compile_jobs_build_parts_that_load_together(tmp_path, capsys):
    """`specrun compile --jobs 2`: buckets 1 and 2 built by two processes as parts of one
    directory; a fresh process loads it, traces nothing and decodes greedily like an eager
    decoder; building again is skipped; one part alone is refused with the command that
    builds the rest."""
    save_target(random_llama(tiny_config(num_layers=1)), tmp_path / "model")
    out = tmp_path / "artifacts"
    args = ["compile", "--model", str(tmp_path / "model"), "--out", str(out), "--jobs", "2"]
    args += ["--device", "cpu", "--dtype", "float32", "--buckets", "1", "2"]
    args += ["--tree", "2", "2", "4", "--max-seq-len", "64", "--skip-filtered"]
    assert cli.main(args) == 0
    parts = aot.artifact_parts(out)
    assert [artifacts.read_manifest(part, rebuild="").built for part in parts] == [(1,), (2,)]
    # Each part measured its rounds for the cost policy (plain ones: no head here).
    profiles = [json.loads((part / cost_profile.ARTIFACT_FILE).read_text()) for part in parts]
    assert [list(p["milliseconds"]) for p in profiles] == [["1"], ["2"]]
    capsys.readouterr()
    assert cli.main(args) == 0 and "is up to date" in capsys.readouterr().out

    cache = tmp_path / "inductor-cache"
    loaded = run_child("load", tmp_path, "--buckets", "1", "2", cache=cache)
    assert jit_compiles(loaded) == {} and precompiled_calls(loaded) > 0, loaded["steps"]
    assert loaded["counters"]["dynamo_graphs"] == 0
    config = EngineConfig(
        device="cpu", dtype="float32", buckets=(1, 2), trees={1: TreeShape(2, 2, 4)},
        max_seq_len=64, compile=True,
    )  # fmt: skip
    eager = _decoder(tmp_path, dataclasses.replace(config, compile=False), head=False)
    greedy = SamplingParams(max_new_tokens=10, ignore_eos=True)
    expected = [decode(eager, prompts(b), greedy) for b in (1, 2)]
    assert loaded["outputs"][::2] == expected  # greedy, then sampled, per bucket

    decoder = _decoder(tmp_path, config, head=False)
    with pytest.raises(ValueError, match=r"hold buckets \[1\] but this engine also needs \[2\]"):
        aot.load_into(decoder, parts[0], rebuild="x")
    with pytest.raises(ValueError, match="buckets to build must be some of"):
        aot.build(decoder, tmp_path / "never", buckets=(4,))


def test_split_buckets_deals_the_largest_first():
    assert aot.split_buckets((1, 2, 4, 8, 16, 32, 64), 3) == [(1, 8, 64), (4, 32), (2, 16)]
    assert aot.split_buckets((1, 2), 4) == [(2,), (1,)]
    with pytest.raises(ValueError, match="at least 1"):
        aot.split_buckets((1,), 0)
