"""Ahead-of-time compile artifacts: build once, ship a directory, start serving without
recompiling.

An artifact directory holds:

- `manifest.json`: what the artifacts were built for (`Manifest`): torch, triton and Python
  versions, the device (GPU name and compute capability, or "cpu" and its vector ISA), dtype,
  hashes of the model and draft-head configs, buckets, the tree of every bucket, KV capacity
  and a hash of the specrun source the compiled steps are made of; plus a checksum of every
  file. A process whose own fingerprint differs in any compared field is refused with a
  ValueError that names the field and says how to rebuild.
- `compile_cache.bin`: PyTorch's portable compile caches ("mega-cache",
  `torch.compiler.save_cache_artifacts`): Inductor's FX-graph cache, AOTAutograd's cache, the
  Triton kernels (compiled binaries) and autotuning results, dynamic-shape profiles. Loaded
  with `torch.compiler.load_cache_artifacts`, every compile of the same graph is a cache hit:
  no Inductor lowering, no Triton compilation, no autotuning. Dynamo still traces the Python.
- `steps/*.bin`: Dynamo's ahead-of-time precompiled steps (`torch.compile(...).aot_compile`,
  experimental in torch 2.10-2.11), one per (bucket, round variant) of the static-shape
  round: loaded with `torch.compiler.load_compiled_function`, they also skip Dynamo tracing.
  Each keeps its serialisable guards but those on the model and head (compile.py,
  `precompile_guard_filter`); a call is dispatched to the first whose guards pass.
- `triton_kernels.zip` (GPU builds): Triton's cache entries for kernels compiled outside
  Inductor while building (custom ops' Triton kernels launched through Triton's JIT, such as
  `rt::tree_attention` placed by a post-grad pass, and their compiled launchers), which the
  mega-cache does not carry; restored into this process's Triton cache directory, so those
  kernels load instead of compiling (and no C compiler runs for their launchers).
- `cpu_kernels.zip` (CPU builds): Inductor's compiled C++ kernel libraries, which the
  mega-cache does not carry; restored into the Inductor cache directory, where they are used
  when the compile command matches (same compiler, flags and paths) and rebuilt otherwise.

Artifacts contain compiled code (pickles and shared libraries): load only directories you
built or trust, as you would a checkpoint.

Nothing here knows a model: callers pass config objects to hash and callables to run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import hashlib
import json
import logging
import os
import platform
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .kernel_archives import (
    cpu_kernel_files,
    find_autotune_results_in_this_cache,
    inductor_cache_dir,
    pack,
    private_triton_cache,
    restore,
    triton_cache_dir,
    triton_cache_files,
)

logger = logging.getLogger(__name__)

ARTIFACT_FORMAT = 1
MANIFEST_FILE = "manifest.json"
CACHE_FILE = "compile_cache.bin"
CPU_KERNELS_FILE = "cpu_kernels.zip"
TRITON_KERNELS_FILE = "triton_kernels.zip"
STEPS_DIR = "steps"
_PACKAGE_ROOT = Path(__file__).resolve().parents[2]
# The specrun source the compiled steps are made of (relative to the package root).
STEP_SOURCES = (
    "models/attention.py",
    "models/config.py",
    "models/eagle.py",
    "models/llama.py",
    "runtime/draft.py",
    "runtime/kv_cache.py",
    "runtime/round.py",
    "runtime/sampling.py",
    "runtime/stochastic.py",
    "runtime/tree.py",
    "runtime/verify.py",
    "runtime/graphs/compile.py",
    "runtime/passes/*.py",
    "runtime/kernels/*.py",
)
_VECTOR_FLAGS = frozenset((
    "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni",
    "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve", "sve2",
))  # fmt: skip


@dataclass(frozen=True)
class Manifest:
    """What an artifact directory was built for (the fields in COMPARED must match the loading
    process) and what it holds (`built`: the buckets whose graphs it has, all of `buckets`
    unless it is one part of a build; `filtered`, `precompiled`, `files`, `command`,
    `created`)."""

    format: int
    torch: str
    triton: str | None
    python: str
    device: str
    capability: str | None
    dtype: str
    model: str
    head: str | None
    buckets: tuple[int, ...]
    trees: tuple[str, ...]
    max_seq_len: int
    cuda_graphs: bool
    steps_source: str
    built: tuple[int, ...] = ()
    filtered: bool = False
    precompiled: tuple[str, ...] = ()
    files: tuple[tuple[str, str], ...] = ()
    command: str = ""
    created: str = ""

    COMPARED = (
        "format", "torch", "triton", "python", "device", "capability", "dtype", "model",
        "head", "buckets", "trees", "max_seq_len", "cuda_graphs", "steps_source",
    )  # fmt: skip

    def mismatches(self, current: Manifest) -> list[tuple[str, Any, Any]]:
        """(field, built for, this process) of every compared field that differs."""
        return [
            (name, getattr(self, name), getattr(current, name))
            for name in self.COMPARED
            if getattr(self, name) != getattr(current, name)
        ]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        names = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(data, dict) or not names.issuperset(data):
            raise ValueError(f"unknown fields {sorted(set(data) - names)}")
        for name in ("buckets", "built", "trees", "precompiled"):
            data[name] = tuple(data.get(name, ()))
        data["files"] = tuple(tuple(pair) for pair in data.get("files", ()))
        return cls(**data)


@dataclass(frozen=True)
class LoadedArtifacts:
    """What `load_artifacts` brought into the process: the manifest, the precompiled steps by
    step name (each a list of callables with `guard_check`), and seconds spent loading."""

    manifest: Manifest
    steps: Mapping[str, tuple[Callable[..., Any], ...]]
    seconds: float


def config_hash(*configs: Any) -> str:
    """A short stable hash of config objects (dataclasses, tuples, plain values)."""
    payload = [dataclasses.asdict(c) if dataclasses.is_dataclass(c) else c for c in configs]
    text = json.dumps(payload, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def steps_source_hash(root: Path = _PACKAGE_ROOT, patterns: Sequence[str] = STEP_SOURCES) -> str:
    """A hash of the source files the compiled steps are made of."""
    hasher = hashlib.sha256(f"format {ARTIFACT_FORMAT}".encode())
    for pattern in patterns:
        for path in sorted(root.glob(pattern)):
            hasher.update(str(path.relative_to(root)).encode())
            hasher.update(path.read_bytes())
    return hasher.hexdigest()[:16]


def device_fingerprint(device: torch.device) -> tuple[str, str | None]:
    """(device, capability): the GPU's name and compute capability, or "cpu" and the machine
    with the vector extensions its C++ kernels may use (read from /proc/cpuinfo: Inductor's
    own probe compiles and runs test programs, seconds per process)."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return torch.cuda.get_device_name(device), f"{major}.{minor}"
    flags: set[str] = set()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags = set(line.partition(":")[2].split())
                break
    return "cpu", " ".join([platform.machine(), *sorted(flags & _VECTOR_FLAGS)])


def triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _shapes_text(shapes: Sequence[Any]) -> str:
    """One bucket's shapes as the manifest records them ("none" for plain decoding)."""
    return " | ".join("none" if shape is None else repr(shape) for shape in shapes)


def current_manifest(
    *,
    device: torch.device,
    dtype: torch.dtype,
    model: Sequence[Any],
    head: Sequence[Any] | None,
    buckets: Sequence[int],
    trees: Sequence[Any],
    max_seq_len: int,
    cuda_graphs: bool,
) -> Manifest:
    """This process's fingerprint. model / head: the config objects that define their graphs
    (hashed); trees: each bucket's trees (the shapes its rounds may run; None for plain
    decoding); cuda_graphs: whether the steps run in CUDA graphs (the KV store, and so the
    graphs' strides, depend on it)."""
    name, capability = device_fingerprint(device)
    return Manifest(
        format=ARTIFACT_FORMAT,
        torch=torch.__version__,
        triton=triton_version(),
        python=platform.python_version(),
        device=name,
        capability=capability,
        dtype=str(dtype).removeprefix("torch."),
        model=config_hash(*model),
        head=None if head is None else config_hash(*head),
        buckets=tuple(buckets),
        trees=tuple(_shapes_text(shapes) for shapes in trees),
        max_seq_len=max_seq_len,
        cuda_graphs=cuda_graphs,
        steps_source=steps_source_hash(),
    )


def compile_counters() -> dict[str, int]:
    """Process-wide compile counters: graphs Dynamo traced, Inductor FX-graph and AOTAutograd
    cache hits and misses (a miss is a real compilation)."""
    from torch._dynamo.utils import counters

    return {
        "dynamo_graphs": counters["stats"]["unique_graphs"],
        "fxgraph_cache_hit": counters["inductor"]["fxgraph_cache_hit"],
        "fxgraph_cache_miss": counters["inductor"]["fxgraph_cache_miss"],
        "autograd_cache_hit": counters["aot_autograd"]["autograd_cache_hit"],
        "autograd_cache_miss": counters["aot_autograd"]["autograd_cache_miss"],
    }


def read_manifest(path: str | Path, *, rebuild: str) -> Manifest:
    """The manifest of an artifact directory; ValueError if there is none or it is unreadable."""
    file = Path(path) / MANIFEST_FILE
    if not file.is_file():
        raise ValueError(f"{path} holds no specrun artifacts (no {MANIFEST_FILE}); {rebuild}")
    try:
        return Manifest.from_json(file.read_text())
    except (ValueError, TypeError) as e:
        raise ValueError(f"artifacts in {path} have an unreadable manifest ({e}); {rebuild}") from e


def verify(found: Manifest, current: Manifest, *, path: str | Path, rebuild: str) -> None:
    """Refuse artifacts built for another torch, device, model, table or source."""
    differences = found.mismatches(current)
    if differences:
        said = "; ".join(
            f"{name}={built!r} but this process has {now!r}" for name, built, now in differences
        )
        raise ValueError(f"artifacts in {path} were built for {said}; {rebuild}")


def check_files(path: str | Path, manifest: Manifest, *, rebuild: str) -> None:
    """Every file the manifest lists exists with its recorded checksum."""
    for name, digest in manifest.files:
        file = Path(path) / name
        if not file.is_file() or _sha256(file) != digest:
            raise ValueError(
                f"artifacts in {path} are damaged: {name} is missing or does not match the "
                f"checksum in {MANIFEST_FILE}; {rebuild}"
            )


def is_up_to_date(path: str | Path, current: Manifest) -> bool:
    """Whether `path` holds intact artifacts built for `current`'s fingerprint."""
    try:
        found = read_manifest(path, rebuild="")
        verify(found, current, path=path, rebuild="")
        check_files(path, found, rebuild="")
    except ValueError:
        return False
    return True


def load_artifacts(path: str | Path, current: Manifest, *, rebuild: str) -> LoadedArtifacts:
    """Verify the artifacts in `path` against this process and load them: the compile caches
    into Inductor's cache, kernel files into Inductor's and Triton's caches, the precompiled
    steps as `DeferredStep`s (loaded on first use)."""
    started = time.perf_counter()
    manifest = read_manifest(path, rebuild=rebuild)
    verify(manifest, current, path=path, rebuild=rebuild)
    check_files(path, manifest, rebuild=rebuild)
    _check_caches_enabled()
    find_autotune_results_in_this_cache()
    info = torch.compiler.load_cache_artifacts((Path(path) / CACHE_FILE).read_bytes())
    cached = time.perf_counter()
    num_kernels = restore(Path(path) / CPU_KERNELS_FILE, inductor_cache_dir())
    num_kernels += restore(Path(path) / TRITON_KERNELS_FILE, triton_cache_dir(), groups=True)
    restored = time.perf_counter()
    steps: dict[str, list[Callable[..., Any]]] = {}
    for name in manifest.precompiled:
        deferred = DeferredStep(Path(path) / STEPS_DIR / f"{name}.bin")
        steps.setdefault(name.split("-")[0], []).append(deferred)
    seconds = time.perf_counter() - started
    logger.info(
        "loaded artifacts from %s in %.2f s (caches %.2f s, %d kernel files %.2f s; "
        "%d precompiled steps load on first use): %s",
        path, seconds, cached - started, num_kernels, restored - cached,
        len(manifest.precompiled), info,
    )  # fmt: skip
    return LoadedArtifacts(manifest, {k: tuple(v) for k, v in steps.items()}, seconds)


class DeferredStep:
    """A precompiled step (`steps/NAME.bin`), loaded on its first guard check.

    The parts of a build each carry the dynamic prefill graphs they needed; a step tries its
    precompiled functions in order and stops at the first whose guards pass, so the copies
    behind it are never loaded. A step that fails to load (precompile is experimental in
    torch) is logged and never passes: the call is then traced and compiled from the
    caches instead."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fn: Any = None
        self._tried = False

    def guard_check(self, *args: Any, **kwargs: Any) -> bool:
        fn = self._load()
        return fn is not None and fn.guard_check(*args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)

    def _load(self) -> Any:
        if self._tried:
            return self._fn
        self._tried = True
        started = time.perf_counter()
        # Guards are rebuilt on load against the thread's dispatch state: load under the
        # mode the steps run in (inference mode), or every tensor guard fails.
        try:
            with open(self.path, "rb") as f, torch.inference_mode():
                fn = torch.compiler.load_compiled_function(f)
        except Exception as e:
            logger.warning(
                "precompiled step %s could not be loaded (%s: %s); it will be traced and "
                "compiled from the caches instead", self.path, type(e).__name__, e,
            )  # fmt: skip
            return None
        fn.disable_guard_check()  # CompiledStep checks guards itself, once per call
        self._fn = fn
        logger.info("loaded %s in %.2f s", self.path, time.perf_counter() - started)
        return fn


@dataclass
class Recording:
    """What `recording()` captured; `cache_dir` is the private Inductor cache of the build,
    `triton_dir` the private Triton cache of kernels compiled outside Inductor."""

    cache_dir: Path
    triton_dir: Path
    steps: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def recording() -> Iterator[Recording]:
    """A build scope: a fresh, private Inductor cache directory (everything compiled inside is
    compiled for real and recorded) and fresh Dynamo state (reset on entry; what is compiled
    inside stays usable after). Put precompiled steps (`aot_compile` results) in
    `recording.steps` under their names, then call `save` inside the block."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
    from torch.compiler._cache import CacheArtifactManager

    torch._dynamo.reset()
    with (
        tempfile.TemporaryDirectory(prefix="specrun-build-") as cache,
        temporary_cache_dir(cache),
        CacheArtifactManager.with_fresh_cache(),
        private_triton_cache(Path(cache) / "triton-jit") as triton_dir,
    ):
        yield Recording(Path(cache), triton_dir)


def save(recording: Recording, out: str | Path, manifest: Manifest) -> Manifest:
    """Write what `recording` compiled to `out` (inside the `recording()` block), replacing any
    previous contents only once the new directory is complete. Returns the final manifest."""
    saved = torch.compiler.save_cache_artifacts()
    if saved is None:
        raise RuntimeError("nothing was compiled while recording; run the steps first")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (staging / CACHE_FILE).write_bytes(saved[0])
        pack(cpu_kernel_files(recording.cache_dir), staging / CPU_KERNELS_FILE)
        triton_files = triton_cache_files(recording.triton_dir)
        pack(triton_files, staging / TRITON_KERNELS_FILE, root=recording.triton_dir)
        (staging / STEPS_DIR).mkdir()
        for name, fn in sorted(recording.steps.items()):
            fn.save_compiled_function(str(staging / STEPS_DIR / f"{name}.bin"))
        files = sorted(p for p in staging.rglob("*") if p.is_file())
        manifest = dataclasses.replace(
            manifest,
            precompiled=tuple(sorted(recording.steps)),
            files=tuple((str(p.relative_to(staging)), _sha256(p)) for p in files),
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        )
        (staging / MANIFEST_FILE).write_text(manifest.to_json())
        replace_dir(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    logger.info("wrote artifacts to %s (%d files)", out, len(manifest.files))
    return manifest


def replace_dir(new: Path, out: Path) -> None:
    """Move the complete `new` into place at `out`, removing the old directory after."""
    old = None
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
        os.replace(out, old / out.name)
    os.replace(new, out)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _check_caches_enabled() -> None:
    inductor, functorch = torch._inductor.config, torch._functorch.config
    if inductor.force_disable_caches or not inductor.fx_graph_cache:
        raise ValueError(
            "artifacts need Inductor's FX graph cache: unset TORCHINDUCTOR_FORCE_DISABLE_CACHES "
            "and TORCHINDUCTOR_FX_GRAPH_CACHE=0"
        )
    if not functorch.enable_autograd_cache:
        logger.warning("AOTAutograd's cache is off: loaded artifacts still skip Inductor")


def _sha256(path: Path) -> str:
    hasher = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            hasher.update(chunk)
    return hasher.hexdigest()
