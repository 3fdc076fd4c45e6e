"""Compiled-kernel files that Inductor's portable caches do not carry, packed into and
restored from artifact archives (runtime/graphs/artifacts.py):

- CPU builds: Inductor's compiled C++ kernel libraries (`<inductor cache>/<2 chars>/<hash>.so`);
- GPU builds: Triton's own cache entries (`<triton cache>/<key>/<files>`) for kernels its JIT
  compiled outside Inductor (custom ops' kernels, their launchers). Triton's group files list
  their entry's files by absolute path: stored relative, restored absolute under the loading
  process's Triton cache directory.

Restoring keeps files already present and writes each new file atomically, so processes
sharing a cache directory may restore concurrently.

`find_autotune_results_in_this_cache` points the statically launched kernels Inductor loads
from its caches at this process's autotuning results (torch 2.11-2.13 keep the building
process's paths in them).
"""

from __future__ import annotations

import contextlib
import json
import os
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

_KERNEL_SUFFIXES = (".so", ".o")
_GROUP_PREFIX = "__grp__"
_INDUCTOR_KERNEL_PREFIXES = ("triton_", f"{_GROUP_PREFIX}triton_")


@contextlib.contextmanager
def private_triton_cache(path: Path) -> Iterator[Path]:
    """Point Triton's own cache at `path` inside the block: every kernel Triton compiles
    there lands in it (its JIT's kernels and launchers, and Inductor's kernels too, which
    `triton_cache_files` leaves out). Kernels compiled inside keep only their binary and
    metadata, not their IRs (`TRITON_STORE_BINARY_ONLY`, also seen by compile workers started
    inside): a loading process writes every file of every kernel Inductor bundled back to
    disk, and these are the files it needs."""
    try:
        from triton import knobs
    except ImportError:  # no Triton (CPU-only installs): nothing is JIT-compiled
        yield path
        return
    with knobs.cache.scope(), knobs.compilation.scope():
        knobs.cache.dir = str(path)
        os.environ["TRITON_STORE_BINARY_ONLY"] = "1"  # restored by the scope
        knobs.compilation.store_binary_only = True
        yield path


def find_autotune_results_in_this_cache() -> None:
    """Make the statically launched Triton kernels that Inductor loads from its caches look up
    their autotuning results in this process's Inductor cache directory (idempotent).

    A kernel with several configs picks one by benchmarking them at its first run and stores
    the winner as `<dir of the kernel's source>/<key>.best_config`. The portable caches carry
    those results, restored as `<this process's cache dir>/<2 chars>/<key>.best_config`, but a
    pickled kernel keeps the source path of the process that compiled it, so as loaded every
    kernel would miss its result (the build's private cache is gone) and be benchmarked again:
    about 50 s at the first start of Llama-3.1-8B shapes at buckets 1-64 on a machine (H200;
    later starts would find what the first wrote at the build's paths). Loading kernels therefore
    rebases that path onto this process's cache directory, keeping the last two parts as the
    portable caches do."""
    from torch._inductor.triton_bundler import TritonBundler

    load_autotuners = TritonBundler.load_autotuners
    if getattr(load_autotuners, "rebased_onto", None) is not None:
        return
    original = load_autotuners.__func__

    def rebased_load_autotuners(cls: type, static_autotuners: list[Any] | None) -> list[str]:
        here = inductor_cache_dir()
        for autotuner in static_autotuners or ():
            if (filename := getattr(autotuner.kernel, "filename", None)) is not None:
                autotuner.kernel.filename = str(here.joinpath(*Path(filename).parts[-2:]))
        return original(cls, static_autotuners)

    rebased_load_autotuners.rebased_onto = original  # type: ignore[attr-defined]
    TritonBundler.load_autotuners = classmethod(rebased_load_autotuners)  # type: ignore[method-assign]


def inductor_cache_dir() -> Path:
    """This process's Inductor cache directory."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def triton_cache_dir() -> Path | None:
    """This process's Triton cache directory (None without Triton)."""
    try:
        from triton import knobs
    except ImportError:
        return None
    return Path(knobs.cache.dir) if knobs.cache.dir else None


def cpu_kernel_files(cache_dir: Path) -> list[tuple[Path, str]]:
    """Inductor's compiled C++ kernel libraries (`<cache>/<2 chars>/<hash>.so|.o`)."""
    return [
        (path, str(path.relative_to(cache_dir)))
        for path in sorted(cache_dir.glob("??/*"))
        if path.suffix in _KERNEL_SUFFIXES and path.is_file()
    ]


def triton_cache_files(triton_dir: Path) -> list[tuple[Path, str]]:
    """Triton cache entries (`<dir>/<key>/<file>`) but Inductor's own kernels (named
    `triton_<kind>_...`, carried by the compile caches already), locks and half-written
    files."""
    entries = [
        entry
        for entry in sorted(triton_dir.glob("*"))
        if entry.is_dir()
        and not entry.name.startswith("tmp.")
        and not any(f.name.startswith(_INDUCTOR_KERNEL_PREFIXES) for f in entry.iterdir())
    ]
    return [
        (path, str(path.relative_to(triton_dir)))
        for entry in entries
        for path in sorted(entry.iterdir())
        if path.is_file() and path.name != "lock"
    ]


def pack(files: list[tuple[Path, str]], archive: Path, *, root: Path | None = None) -> int:
    """Zip `files` ((path, name in the archive) pairs) into `archive`, if there are any.
    With `root`, Triton group files (`__grp__*.json`, which list their entry's files by
    absolute path) are stored with those paths relative to `root`."""
    if files:
        with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_DEFLATED) as zf:
            for path, name in files:
                if root is not None and path.name.startswith(_GROUP_PREFIX):
                    relative = _rebased_group(path.read_bytes(), lambda p: os.path.relpath(p, root))
                    zf.writestr(name, relative)
                else:
                    zf.write(path, name)
    return len(files)


def restore(archive: Path, root: Path | None, *, groups: bool = False) -> int:
    """Unpack `archive` (if it exists) into the cache directory `root`, keeping files already
    there (`groups`: Triton group files get their paths made absolute under `root`); returns
    the number of files written."""
    if root is None or not archive.is_file():
        return 0
    count = 0
    with zipfile.ZipFile(archive) as zf:
        for member in zf.namelist():
            target = root / member
            if Path(member).is_absolute() or ".." in Path(member).parts or target.exists():
                continue
            data = zf.read(member)
            if groups and target.name.startswith(_GROUP_PREFIX):
                data = _rebased_group(data, lambda p: root / p)
            target.parent.mkdir(parents=True, exist_ok=True)
            partial = target.with_name(f".{target.name}.{os.getpid()}")
            partial.write_bytes(data)
            os.replace(partial, target)
            count += 1
    return count


def _rebased_group(data: bytes, rebase: Callable[[str], Any]) -> bytes:
    group = json.loads(data)
    paths = group.get("child_paths", {})
    group["child_paths"] = {name: str(rebase(path)) for name, path in paths.items()}
    return json.dumps(group).encode()
