"""Frozen, validated configuration objects of the public API.

Every check lives in `__post_init__` and raises ValueError/TypeError saying what to change, so a
bad request is refused at the boundary before it touches any shared state.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch

from .acceptance import MeasuredAcceptance
from .tree import StaticTree, TreeShape

# The batch-1 tree of the published EAGLE-3 Llama-3.1-8B results.
DEFAULT_TREE = TreeShape(depth=7, topk=10, num_nodes=60)
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# Per batch bucket, the tree of the largest key not above it: deep and wide where the target
# forward is memory-bound and verifying 60 nodes costs about as much as 1, shallower and
# narrower as the batch makes verification compute-bound (see BENCHMARKS.md).
DEFAULT_TREES: Mapping[int, TreeShape | StaticTree | None] = MappingProxyType(
    {
        1: DEFAULT_TREE,
        2: TreeShape(depth=6, topk=8, num_nodes=48),
        4: TreeShape(depth=6, topk=8, num_nodes=32),
        8: TreeShape(depth=5, topk=8, num_nodes=24),
        16: TreeShape(depth=4, topk=6, num_nodes=16),
        32: TreeShape(depth=3, topk=4, num_nodes=8),
        64: TreeShape(depth=2, topk=2, num_nodes=4),
    }
)

# The speculation policies by name (runtime/policies/ builds them).
POLICY_NAMES = ("cost", "fixed", "batch-table", "ema", "gammatune", "dsde")

# A draft-head directory may carry the tree shapes measured best for it (see default_trees).
HEAD_TREES_FILE = "trees.json"


def default_trees(draft: str | Path | None = None) -> Mapping[int, TreeShape | StaticTree | None]:
    """The tree table an engine uses unless told otherwise: DEFAULT_TREES, with the draft
    head's own table over it when its directory has `trees.json`,
    `{"trees": {"BUCKET": [DEPTH, TOPK, NUM_NODES], ...}}` (the shapes measured best for that
    head and its target; a small target makes every draft step count, so its best trees are
    smaller than the table tuned for Llama-3.1-8B shapes); a fourth entry `true` makes the
    tree stochastic (`TreeShape.stochastic`)."""
    path = Path(draft) / HEAD_TREES_FILE if draft is not None else None
    if path is None or not path.is_file():
        return DEFAULT_TREES
    try:
        table = _read_json(path)["trees"]
        trees = {int(bucket): TreeShape(*shape) for bucket, shape in table.items()}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(
            f'{path}: expected {{"trees": {{"BUCKET": [DEPTH, TOPK, NUM_NODES], ...}}}} '
            f"({type(e).__name__}: {e}); fix the file or remove it to use the default trees"
        ) from e
    return MappingProxyType({**DEFAULT_TREES, **trees})  # EngineConfig sorts its table


def head_acceptance(draft: str | Path | None) -> MeasuredAcceptance | None:
    """What the draft head accepted when it was measured, from the `accepted` entry of its
    directory's `trees.json`: `{"tree": [DEPTH, TOPK, NUM_NODES], "greedy": TOKENS_PER_ROUND,
    "sampling": TOKENS_PER_ROUND}` (either rate may be left out); None without one. The
    adaptive policies start from it (runtime/acceptance.py)."""
    path = Path(draft) / HEAD_TREES_FILE if draft is not None else None
    if path is None or not path.is_file():
        return None
    entry = _read_json(path).get("accepted")
    if entry is None:
        return None
    try:
        return MeasuredAcceptance(
            TreeShape(*entry["tree"]), greedy=entry.get("greedy"), sampling=entry.get("sampling")
        )
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(
            f'{path}: expected "accepted": {{"tree": [DEPTH, TOPK, NUM_NODES], "greedy": '
            f'TOKENS_PER_ROUND, "sampling": TOKENS_PER_ROUND}} ({type(e).__name__}: {e}); fix '
            "the entry or remove it"
        ) from e


def _read_json(path: Path) -> dict:
    try:
        found = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path} is not JSON ({e}); fix the file or remove it") from e
    if not isinstance(found, dict):
        raise ValueError(f"{path} must hold a JSON object; fix the file or remove it")
    return found


def stochastic_trees(
    trees: Mapping[int, TreeShape | StaticTree | None],
) -> dict[int, TreeShape | StaticTree | None]:
    """The table with every TreeShape stochastic (static trees and plain decoding as they
    are)."""
    return {
        bucket: dataclasses.replace(tree, stochastic=True) if isinstance(tree, TreeShape) else tree
        for bucket, tree in trees.items()
    }


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request.

    temperature: 0 means greedy (argmax); > 0 samples from softmax(logits / temperature).
    top_k: keep the k most likely tokens (0 = no limit).
    top_p: keep the smallest set of tokens whose probability reaches top_p (1 = no limit).
    max_new_tokens: generated tokens at most (the stop token included).
    stop_token_ids: extra ids that end the request, besides the model's EOS ids.
    ignore_eos: keep going past EOS (benchmarks); stop_token_ids still apply.
    seed: an int in [0, 2**64): the request's random numbers are a function of its seed and
        token positions (runtime/rng.py), so a seeded request samples the same tokens alone
        or in any batch; None draws a fresh seed.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        _check_number("temperature", self.temperature)
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(
                f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}"
            )
        _check_int("top_k", self.top_k)
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 disables it), got {self.top_p}")
        _check_int("max_new_tokens", self.max_new_tokens)
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(
            self.stop_token_ids, "__iter__"
        ):
            raise TypeError("stop_token_ids must be a sequence of token ids")
        stop_ids = tuple(self.stop_token_ids)
        for token in stop_ids:
            _check_int("stop_token_ids entry", token)
            if token < 0:
                raise ValueError(f"stop_token_ids must be >= 0, got {token}")
        object.__setattr__(self, "stop_token_ids", stop_ids)
        _check_bool("ignore_eos", self.ignore_eos)
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not 0 <= self.seed < 2**64:
                raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")


def _check_bool(name: str, value: object, *, optional: bool = False) -> None:
    if not isinstance(value, bool) and not (optional and value is None):
        allowed = "True, False or None" if optional else "True or False"
        raise TypeError(f"{name} must be {allowed}, got {type(value).__name__} {value!r}")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")


def validate_prompt_ids(prompt: object, *, vocab_size: int, index: int = 0) -> list[int]:
    """Check one tokenized prompt; returns it as a list of ints."""
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Sequence):
        hint = " (convert it with .tolist())" if hasattr(prompt, "tolist") else ""
        raise TypeError(
            f"prompt {index} must be a list of token ids, got {type(prompt).__name__}{hint}"
        )
    ids = list(prompt)
    if not ids:
        raise ValueError(f"prompt {index} is empty; give at least one token")
    for token in ids:
        _check_int(f"prompt {index} token id", token)
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"prompt {index} has token ids outside [0, {vocab_size}): {bad[:8]}; "
            "they must come from this model's tokenizer"
        )
    return ids


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def auto_dtype(device: torch.device) -> torch.dtype:
    """What `EngineConfig(dtype="auto")` runs in on `device`: bfloat16 on CUDA and on a CPU
    that multiplies bfloat16 natively (x86 AVX512-BF16 or AMX-BF16, `torch.cpu.
    get_capabilities`, with oneDNN to run the matmuls), float32 on other CPUs.

    Decoding reads every weight once per token, so bfloat16 halves the bytes a step reads: on
    a 2-core AVX512-BF16 EPYC the embedded model decodes about 1.6x faster than in float32
    (BENCHMARKS.md). Without those instructions bfloat16 is widened in software and float32
    is the faster one. oneDNN's bfloat16 matmul keeps memory for every row count it
    multiplies; CPU prefills are padded and grouped to a few row counts so that it stays
    bounded (runtime/slots.py, `max_prefill_rows`). A torch without `get_capabilities`
    reads as no native support."""
    if device.type == "cuda":
        return torch.bfloat16
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return torch.float32
    capabilities = getattr(torch.cpu, "get_capabilities", dict)()
    native = capabilities.get("avx512_bf16") or capabilities.get("amx_bf16")
    return torch.bfloat16 if native else torch.float32


# The parameters of a slot that pads a batch up to its bucket: it asks for no tokens, so it is
# done from the start.
PADDING_PARAMS = SamplingParams(max_new_tokens=0)


@dataclass(frozen=True)
class EngineConfig:
    """How the engine runs.

    device: "auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N".
    dtype: "auto" (bfloat16 on CUDA and on CPUs with bfloat16 instructions, AVX512-BF16 or
        AMX; float32 on other CPUs: see `auto_dtype`), "float32", "bfloat16" or "float16".
    chat_template: wrap string prompts in the model's chat template as a user message.
    buckets: the batch sizes decoding is compiled and captured for; a batch pads up to the
        next bucket.
    trees: bucket -> draft tree used with a draft head (a dynamic TreeShape or a StaticTree;
        None = plain decoding at that bucket). A bucket takes the tree of the largest key not
        above it, so `{1: TreeShape(4, 4, 16)}` uses one tree everywhere.
    max_seq_len: KV positions per slot: prompt + max_new_tokens + 2 * (tree depth + 1) must
        fit.
    compile: compile prefill and rounds with Inductor and specrun's passes (None: on CUDA).
    cuda_graphs: replay each bucket's round as one CUDA graph (None: on CUDA; needs CUDA).
    prefill_graph_tokens: with CUDA graphs, a prefill whose bucket x padded prompt length
        (see prefill_length) is at most this replays a graph captured for that pair on
        first use; longer prefills run the compiled forwards (0: always). The graphs share the
        rounds' memory pool, which grows to the largest prefill's activations.
    queue: accept lists of prompts larger than the largest bucket in `generate` (False:
        refuse them).
    max_waiting: requests that may wait for a slot; `submit` beyond it raises
        EngineOverloadedError (`generate` and `stream` wait for room).
    max_prefill_tokens: prompt tokens prefilled between two rounds: bounds how long
        admissions delay the running requests' next round. A longer prompt is prefilled in
        chunks of at most this many tokens, one chunk between two rounds, while the running
        requests keep decoding (with `continuous_batching`; static batches admit prompts
        whole, the first always).
    continuous_batching: admit waiting requests into free slots while others decode (False:
        only when none runs, i.e. static batches that end with their slowest request; for
        comparison).
    policy: how each round's tree is chosen among the bucket's ladder of shapes (its tree,
        smaller ones, plain decoding; runtime/policies/): "cost" (expected tokens per
        measured second), "fixed" (the bucket's tree, nothing else is built), "batch-table",
        "ema", "gammatune" or "dsde".
    tensor_parallel: the number of ranks (processes, one GPU each on CUDA) the target is split
        over (models/tensor_parallel.py; runtime/ranks.py starts them). Its attention heads, KV
        heads, MLP width and vocabulary must divide by it; the draft head is replicated.
    """

    device: str = "auto"
    dtype: str = "auto"
    chat_template: bool = True
    buckets: tuple[int, ...] = DEFAULT_BUCKETS
    trees: Mapping[int, TreeShape | StaticTree | None] = dataclasses.field(
        default_factory=lambda: DEFAULT_TREES
    )
    max_seq_len: int = 2048
    compile: bool | None = None
    cuda_graphs: bool | None = None
    prefill_graph_tokens: int = 4096
    queue: bool = True
    max_waiting: int = 1024
    max_prefill_tokens: int = 4096
    continuous_batching: bool = True
    policy: str = "cost"
    tensor_parallel: int = 1

    def __reduce__(self) -> tuple:
        # Picklable for worker processes (the tree table is a read-only mapping proxy).
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return _engine_config, (fields | {"trees": dict(self.trees)},)

    def __post_init__(self) -> None:
        for name in ("device", "dtype"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name} must be a string, got {getattr(self, name)!r}")
        for name in ("chat_template", "queue", "continuous_batching"):
            _check_bool(name, getattr(self, name))
        for name in ("compile", "cuda_graphs"):
            _check_bool(name, getattr(self, name), optional=True)
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise ValueError(
                f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {self.dtype!r}"
            )
        if self.device != "auto":
            try:
                torch.device(self.device)
            except RuntimeError as e:
                raise ValueError(f"device {self.device!r} is not a torch device: {e}") from None
        if self.policy not in POLICY_NAMES:
            raise ValueError(f"policy must be one of {list(POLICY_NAMES)}, got {self.policy!r}")
        object.__setattr__(self, "buckets", _checked_buckets(self.buckets))
        object.__setattr__(self, "trees", _checked_trees(self.trees, self.buckets))
        _check_int("max_seq_len", self.max_seq_len)
        if self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be at least 2, got {self.max_seq_len}")
        for name in ("max_waiting", "max_prefill_tokens"):
            _check_int(name, getattr(self, name))
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        _check_int("tensor_parallel", self.tensor_parallel)
        if self.tensor_parallel < 1:
            raise ValueError(
                f"tensor_parallel is the number of ranks the model is split over and must be at "
                f"least 1 (1: one process, no splitting), got {self.tensor_parallel}"
            )
        _check_int("prefill_graph_tokens", self.prefill_graph_tokens)
        if self.prefill_graph_tokens < 0:
            raise ValueError(
                f"prefill_graph_tokens must be 0 (no prefill graphs) or more, got "
                f"{self.prefill_graph_tokens}"
            )

    def tree_for(self, bucket: int) -> TreeShape | StaticTree | None:
        """The draft tree of a batch bucket (None: plain decoding)."""
        return self.trees[max(k for k in self.trees if k <= bucket)]

    def bucket_for(self, batch_size: int) -> int:
        """The smallest bucket that holds `batch_size` slots."""
        for bucket in self.buckets:
            if bucket >= batch_size:
                return bucket
        raise ValueError(
            f"a batch of {batch_size} is larger than the largest bucket {self.buckets[-1]}; "
            "add a bucket (EngineConfig(buckets=...)) or enable queue=True"
        )

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for but no CUDA GPU is available; use 'cpu'")
        return device

    def resolved_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return auto_dtype(self.resolved_device())
        return _DTYPES[self.dtype]

    def resolved_compile(self) -> bool:
        return self.resolved_device().type == "cuda" if self.compile is None else self.compile

    def resolved_cuda_graphs(self) -> bool:
        on_cuda = self.resolved_device().type == "cuda"
        if self.cuda_graphs and not on_cuda:
            raise ValueError("cuda_graphs=True needs a CUDA device; use cuda_graphs=False on CPU")
        return on_cuda if self.cuda_graphs is None else self.cuda_graphs


def _engine_config(fields: dict) -> EngineConfig:
    return EngineConfig(**fields)


def _checked_buckets(buckets: object) -> tuple[int, ...]:
    if isinstance(buckets, (str, bytes)) or not hasattr(buckets, "__iter__"):
        raise TypeError(f"buckets must be a sequence of batch sizes, got {buckets!r}")
    buckets = tuple(buckets)
    for bucket in buckets:
        _check_int("bucket", bucket)
    if not buckets or buckets[0] < 1 or list(buckets) != sorted(set(buckets)):
        raise ValueError(f"buckets must be increasing positive batch sizes, got {buckets}")
    return buckets


def _checked_trees(
    trees: object, buckets: tuple[int, ...]
) -> Mapping[int, TreeShape | StaticTree | None]:
    if not isinstance(trees, Mapping) or not trees:
        raise TypeError(
            "trees must be a non-empty mapping bucket -> TreeShape | StaticTree | None, "
            f"got {type(trees).__name__}"
        )
    for key, tree in trees.items():
        _check_int("trees key", key)
        if tree is not None and not isinstance(tree, (TreeShape, StaticTree)):
            raise TypeError(
                f"trees[{key}] must be a TreeShape, StaticTree or None, got {type(tree).__name__}"
            )
    if min(trees) > buckets[0]:
        raise ValueError(
            f"trees has no entry for bucket {buckets[0]}: its smallest key is {min(trees)}; "
            f"add trees[{buckets[0]}]"
        )
    return MappingProxyType(dict(sorted(trees.items())))
