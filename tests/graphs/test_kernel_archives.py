"""Kernel archives (runtime/graphs/kernel_archives.py): Triton cache entries written by a
build's JIT are found by Triton's own cache manager in another cache directory once
restored, and restoring never overwrites what a cache already holds; statically launched
kernels loaded from Inductor's caches look up autotuning results in this process's cache."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from specrun.runtime.graphs import kernel_archives

triton = pytest.importorskip("triton")
from triton import knobs  # noqa: E402
from triton.runtime.cache import get_cache_manager  # noqa: E402

KEY = "5d41402abc4b2a76b9719d911017c592" * 2  # a hex hash, as Triton keys are


def _write_entry(files: dict[str, bytes]) -> str:
    """A kernel's entry in the current Triton cache, as Triton's compiler writes it; returns
    the entry's directory name."""
    manager = get_cache_manager(KEY)
    paths = {name: manager.put(data, name) for name, data in files.items()}
    return Path(manager.put_group("kernel.json", paths)).parent.name


def test_triton_entries_restore_where_triton_finds_them(tmp_path):
    build, serve = tmp_path / "build", tmp_path / "serve"
    files = {"kernel.cubin": b"\x7fELF cubin", "kernel.json": b'{"name": "kernel"}'}
    before = knobs.cache.dir
    with kernel_archives.private_triton_cache(build):
        assert kernel_archives.triton_cache_dir() == build
        entry = _write_entry(files)
        # Inductor's kernels travel in the compile caches: left out of the archive.
        manager = get_cache_manager("ab" * 32)
        manager.put_group("triton_poi_fused_add_0.json", {"x": manager.put(b"{}", "x.json")})
    assert knobs.cache.dir == before  # the build's redirection does not outlive it

    archive = tmp_path / "triton_kernels.zip"
    listed = kernel_archives.triton_cache_files(build)
    assert kernel_archives.pack(listed, archive, root=build) == 3
    stored = json.loads(zipfile.ZipFile(archive).read(f"{entry}/__grp__kernel.json"))
    assert all(not Path(p).is_absolute() for p in stored["child_paths"].values())

    assert kernel_archives.restore(archive, serve, groups=True) == 3
    with kernel_archives.private_triton_cache(serve):
        group = get_cache_manager(KEY).get_group("kernel.json")
    assert group is not None, "Triton does not find the restored entry"
    assert {name: Path(path).read_bytes() for name, path in group.items()} == files
    assert all(Path(path).is_relative_to(serve) for path in group.values())


def test_restore_keeps_existing_files_and_refuses_paths_outside(tmp_path):
    archive = tmp_path / "kernels.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        zf.writestr("ab/kept.so", b"from the archive")
        zf.writestr("ab/new.so", b"new")
        zf.writestr("../escape.so", b"outside")
    root = tmp_path / "cache"
    (root / "ab").mkdir(parents=True)
    (root / "ab" / "kept.so").write_bytes(b"already here")
    assert kernel_archives.restore(archive, root) == 1
    assert (root / "ab" / "kept.so").read_bytes() == b"already here"
    assert (root / "ab" / "new.so").read_bytes() == b"new"
    assert not (tmp_path / "escape.so").exists()
    assert kernel_archives.restore(tmp_path / "missing.zip", root) == 0


def test_loaded_static_kernels_find_autotune_results_in_this_cache():
    """A kernel pickled by a build keeps the build's source path; loading rebases it onto this
    process's Inductor cache (where the portable caches restore `<2 chars>/<key>.best_config`)
    and hands it on to Inductor's loader, once however often the rebase is installed."""
    from torch._inductor.async_compile import CompiledTritonKernels
    from torch._inductor.triton_bundler import TritonBundler

    kernel_archives.find_autotune_results_in_this_cache()
    installed = TritonBundler.load_autotuners
    kernel_archives.find_autotune_results_in_this_cache()
    assert TritonBundler.load_autotuners == installed

    built = SimpleNamespace(filename="/tmp/specrun-build-x1/ab/abc123.py", compile_results=[])
    autotuner = SimpleNamespace(kernel=built, cache_key="specrun-test-kernel", kernel_name="k")
    try:
        assert TritonBundler.load_autotuners([autotuner]) == ["k"]
        assert "specrun-test-kernel" in CompiledTritonKernels._cache
    finally:
        CompiledTritonKernels._cache.pop("specrun-test-kernel", None)
    here = kernel_archives.inductor_cache_dir()
    assert built.filename == str(here / "ab" / "abc123.py")
