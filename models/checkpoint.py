"""Checkpoint files: find them, read their headers, check them, stream their tensors.

A checkpoint directory holds one of (looked for in this order)
  model.safetensors.index.json + shards, model.safetensors,
  pytorch_model.bin.index.json + shards, pytorch_model.bin.
Headers (names, shapes, dtypes) are read without touching tensor data, so a checkpoint is
checked against the model before anything is allocated; tensors are then read one at a time.
Legacy .bin files are only ever opened with `torch.load(weights_only=True, mmap=True)`: no
code in them runs, and their data stays in the page cache until each tensor is converted.
Key names are the files' own; renaming is loading.py's business. `write_safetensors` writes
one model.safetensors, or shards plus an index when a size limit asks for them.
A file that cannot be read (truncated by an interrupted download, a Git LFS pointer, a
malformed index) is a ValueError naming it and saying how to get a good copy.
"""

from __future__ import annotations

import json
import logging
import pickle
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .json_fields import read_json

logger = logging.getLogger(__name__)

WEIGHT_FILES = (
    "model.safetensors.index.json",
    "model.safetensors",
    "pytorch_model.bin.index.json",
    "pytorch_model.bin",
)

_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorInfo:
    """What a checkpoint header says about one tensor."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class TensorSpec:
    """What the model expects: dtype None means any floating dtype (converted on load)."""

    shape: tuple[int, ...]
    dtype: torch.dtype | None = None


def existing_dir(path: str | Path) -> Path:
    directory = Path(path)
    if not directory.is_dir():
        raise ValueError(f"model directory {directory} does not exist (or is not a directory)")
    return directory


class Checkpoint:
    """The tensors of one checkpoint directory: `infos` from headers, data on demand."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = existing_dir(directory)
        self.path = _find_weights(self.directory)
        shards = _shard_files(self.path)
        self._bin_states = {s: _load_bin(s) for s in shards if s.suffix == ".bin"}
        self._file_of: dict[str, Path] = {}
        self.infos: dict[str, TensorInfo] = {}
        for shard in shards:
            for name, info in self._read_header(shard).items():
                if name in self.infos:
                    raise ValueError(f"tensor {name} appears in more than one shard of {self.path}")
                self.infos[name] = info
                self._file_of[name] = shard
        logger.info(
            "checkpoint %s: %d tensors in %d file(s)", self.path, len(self.infos), len(shards)
        )

    def _read_header(self, shard: Path) -> dict[str, TensorInfo]:
        if shard in self._bin_states:
            state = self._bin_states[shard]
            return {name: TensorInfo(tuple(t.shape), t.dtype) for name, t in state.items()}
        with _open_safetensors(shard) as f:
            # safe_open handles are not iterable, hence .keys().
            return {name: _safetensors_info(f, name, shard) for name in f.keys()}  # noqa: SIM118

    def tensors(self, names: Iterable[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, CPU tensor) for `names`, one at a time, one shard open at a time."""
        return self._read(names, blocks=None)

    def slices(self, blocks: Mapping[str, tuple[slice, ...]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, CPU tensor) for each name of `blocks`, only its block read: from a
        safetensors file the block's bytes alone (`get_slice`); a legacy .bin file is read
        whole when opened."""
        return self._read(blocks, blocks=blocks)

    def _read(
        self, names: Iterable[str], *, blocks: Mapping[str, tuple[slice, ...]] | None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        by_file: dict[Path, list[str]] = {}
        for name in names:
            by_file.setdefault(self._file_of[name], []).append(name)
        for shard, shard_names in by_file.items():
            if shard in self._bin_states:
                state = self._bin_states[shard]
                for name in shard_names:
                    whole = state[name]
                    yield name, whole if blocks is None else whole[blocks[name]].clone()
                continue
            with _open_safetensors(shard, device="cpu") as f:
                for name in shard_names:
                    if blocks is None:
                        yield name, f.get_tensor(name)
                    else:
                        yield name, f.get_slice(name)[blocks[name]]


def _find_weights(directory: Path) -> Path:
    for name in WEIGHT_FILES:
        if (directory / name).is_file():
            return directory / name
    raise ValueError(f"no weights in {directory}: looked for {', '.join(WEIGHT_FILES)}")


def _shard_files(path: Path) -> list[Path]:
    if not path.name.endswith(".index.json"):
        return [path]
    shards = [path.parent / name for name in sorted(set(_weight_map(path).values()))]
    missing = [str(s.name) for s in shards if not s.is_file()]
    if missing:
        raise ValueError(
            f"{path} names shard file(s) that do not exist: {missing}; {_GET_A_GOOD_COPY}"
        )
    return shards


def _weight_map(path: Path) -> dict[str, str]:
    """The tensor name -> shard file map of a Hugging Face index file."""
    index = read_json(path, fix=_GET_A_GOOD_COPY)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(
            f'{path} has no "weight_map" object naming the shard of each tensor; {_GET_A_GOOD_COPY}'
        )
    # Shards live beside the index: a name with a directory in it is not a shard of this model.
    bad = [f for f in weight_map.values() if not isinstance(f, str) or Path(f).name != f]
    if bad:
        raise ValueError(
            f'{path}: "weight_map" must map tensor names to shard file names beside it, '
            f"got {bad[:3]}; {_GET_A_GOOD_COPY}"
        )
    return weight_map


_GET_A_GOOD_COPY = "re-download the model, or re-convert it if you wrote it yourself"
_LFS_POINTER = b"version https://git-lfs"


@contextmanager
def _open_safetensors(shard: Path, **kwargs) -> Iterator:
    """safe_open, with a file it cannot read reported as a ValueError that names it."""
    try:
        with safe_open(shard, framework="pt", **kwargs) as f:
            yield f
    except SafetensorError as error:
        raise ValueError(_unreadable(shard, str(error))) from error


def _unreadable(path: Path, reason: str) -> str:
    """Why `path` cannot be read, and what to do about it."""
    with path.open("rb") as f:
        start = f.read(len(_LFS_POINTER))
    if start == _LFS_POINTER:
        # A clone without git-lfs holds ~130-byte pointer files in place of the weights.
        fetch = "run `git lfs pull` in its repository"
        return f"{path} is a Git LFS pointer, not the weights: {fetch}, or {_GET_A_GOOD_COPY}"
    size = path.stat().st_size
    # The first sentence says what failed; torch appends a paragraph of guesses.
    reason = reason.splitlines()[0].split(". ")[0]
    return f"{path} is truncated or corrupt ({size} bytes; {reason}); {_GET_A_GOOD_COPY}"


def _safetensors_info(f, name: str, shard: Path) -> TensorInfo:
    tensor_slice = f.get_slice(name)
    dtype_name = tensor_slice.get_dtype()
    if dtype_name not in _SAFETENSORS_DTYPES:
        raise ValueError(f"{shard}: tensor {name} has unsupported dtype {dtype_name}")
    return TensorInfo(tuple(tensor_slice.get_shape()), _SAFETENSORS_DTYPES[dtype_name])


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    """A legacy PyTorch state dict, unpickled with weights_only (no code runs) and mmap."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (EOFError, OSError) as error:
        raise ValueError(_unreadable(path, str(error))) from error
    except (pickle.UnpicklingError, RuntimeError) as error:
        reason = str(error).splitlines()[0]
        # torch's zip reader failing means a damaged file, not a refused object inside it.
        if "zip archive" in reason:
            raise ValueError(_unreadable(path, reason)) from error
        raise ValueError(
            f"{path} is not a plain tensor checkpoint readable with "
            f"torch.load(weights_only=True, mmap=True): {reason}"
        ) from error
    if not isinstance(state, Mapping):
        raise ValueError(f"{path} holds a {type(state).__name__}, not a dict of tensors")
    not_tensors = sorted(k for k, v in state.items() if not isinstance(v, torch.Tensor))
    if not_tensors:
        raise ValueError(f"{path}: entries {not_tensors} are not tensors")
    return dict(state)


def check_tensors(
    found: Mapping[str, TensorInfo],
    expected: Mapping[str, TensorSpec],
    *,
    optional: Mapping[str, TensorSpec],
    source: str,
) -> None:
    """Raise one ValueError listing every way `found` differs from `expected`.

    `optional` tensors may be absent; when present they are checked like expected ones
    (the caller then ignores them).
    """
    problems = []
    missing = sorted(expected.keys() - found.keys())
    if missing:
        problems.append(f"missing: {', '.join(missing)}")
    unexpected = sorted(found.keys() - expected.keys() - optional.keys())
    if unexpected:
        problems.append(f"unexpected: {', '.join(unexpected)}")
    for name in sorted(found.keys() & (expected.keys() | optional.keys())):
        spec = expected.get(name) or optional[name]
        problems += _tensor_problems(name, found[name], spec)
    if problems:
        raise ValueError(f"{source} does not match the model:\n  " + "\n  ".join(problems))


def _tensor_problems(name: str, info: TensorInfo, spec: TensorSpec) -> list[str]:
    problems = []
    if info.shape != spec.shape:
        problems.append(f"mis-shaped: {name}: expected {list(spec.shape)}, got {list(info.shape)}")
    if spec.dtype is None and not info.dtype.is_floating_point:
        problems.append(f"non-floating dtype: {name}: {info.dtype} (weights must be floating)")
    if spec.dtype is not None and info.dtype != spec.dtype:
        problems.append(f"wrong dtype: {name}: expected {spec.dtype}, got {info.dtype}")
    return problems


def write_safetensors(
    tensors: Mapping[str, torch.Tensor], out_dir: Path, *, max_shard_bytes: int | None = None
) -> list[Path]:
    """Write `tensors` (moved to the CPU) into `out_dir`; returns the files written.

    Without a limit, or when everything fits under it, this is one model.safetensors.
    Otherwise tensors go in name order into model-0000i-of-0000n.safetensors shards of at
    most `max_shard_bytes` each (a single larger tensor gets a shard of its own), with the
    Hugging Face model.safetensors.index.json beside them. Stale weight files are removed
    first so the directory never holds two layouts.
    """
    if max_shard_bytes is not None and max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be positive, not {max_shard_bytes}")
    plain = {name: _owned_cpu_copy(t) for name, t in tensors.items()}
    for stale in [*out_dir.glob("model*.safetensors"), out_dir / WEIGHT_FILES[0]]:
        stale.unlink(missing_ok=True)
    shards = _plan_shards(plain, max_shard_bytes)
    if len(shards) == 1:
        path = out_dir / "model.safetensors"
        save_file(plain, path, metadata={"format": "pt"})
        return [path]
    paths, weight_map = [], {}
    for i, names in enumerate(shards):
        path = out_dir / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: plain[n] for n in names}, path, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(names, path.name)
        paths.append(path)
    total = sum(t.numel() * t.element_size() for t in plain.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / WEIGHT_FILES[0]).write_text(json.dumps(index, indent=2) + "\n")
    return [*paths, out_dir / WEIGHT_FILES[0]]


def _owned_cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` on the CPU in storage of its own: safetensors refuses tensors that share
    memory, as the parts of a fused projection's state dict do (views of one weight)."""
    tensor = tensor.detach().to("cpu")
    if tensor.untyped_storage().nbytes() != tensor.numel() * tensor.element_size():
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor.contiguous()


def _plan_shards(tensors: Mapping[str, torch.Tensor], max_bytes: int | None) -> list[list[str]]:
    if max_bytes is None:
        return [sorted(tensors)]
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(tensors):
        num_bytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + num_bytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += num_bytes
    return shards
