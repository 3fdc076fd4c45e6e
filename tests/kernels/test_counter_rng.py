"""`rt::counter_uniform`: the Triton kernel computes the reference's bits exactly (under
TRITON_INTERPRET=1 on the CPU, and on the GPU, inside a CUDA graph too), the op passes
opcheck, and the uniforms are keyed by seed, counter, site and element."""

from __future__ import annotations

import sys

import pytest
import torch
from triton_interpreter import assert_script_passes_under_interpreter

from specrun.runtime.kernels.counter_rng import counter_uniform, counter_uniform_ref

# (batch, counters per row, elements): one block and several, an odd tail, a single element.
CASES = ((1, 1, 1), (3, 5, 1000), (2, 4, 2049), (4, 1, 49152))


def random_inputs(batch: int, num_counters: int, *, seed: int, device: str = "cpu"):
    generator = torch.Generator().manual_seed(seed)
    seeds = torch.randint(0, 2**32, (batch, 2), generator=generator, dtype=torch.int64)
    counters = torch.randint(0, 2**32, (batch, num_counters), generator=generator)
    return seeds.to(device), counters.to(device)


def test_opcheck():
    seeds, counters = random_inputs(2, 3, seed=0)
    torch.library.opcheck(torch.ops.rt.counter_uniform.default, (seeds, counters, 17, 2))


def test_reference_keys_its_draws():
    seeds, counters = random_inputs(2, 2, seed=1)
    u = counter_uniform_ref(seeds, counters, 4096, 1)
    assert u.shape == (2, 2, 4096) and bool(((u > 0) & (u < 1)).all())
    assert torch.equal(u, counter_uniform_ref(seeds, counters, 4096, 1))
    assert not torch.equal(u, counter_uniform_ref(seeds, counters, 4096, 2))
    assert torch.equal(u[:, :, :100], counter_uniform_ref(seeds, counters, 100, 1))


def test_triton_kernel_under_interpreter():
    assert_script_passes_under_interpreter(__file__)


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_gpu_kernel_matches_reference_bit_for_bit(case):
    batch, num_counters, num_elements = case
    seeds, counters = random_inputs(batch, num_counters, seed=num_elements, device="cuda")
    got = counter_uniform(seeds, counters, num_elements, 3)
    assert torch.equal(got.cpu(), counter_uniform_ref(seeds.cpu(), counters.cpu(), num_elements, 3))


@pytest.mark.gpu
def test_gpu_kernel_replays_in_a_cuda_graph():
    seeds, counters = random_inputs(2, 3, seed=5, device="cuda")
    counter_uniform(seeds, counters, 3000, 1)  # compiles the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = counter_uniform(seeds, counters, 3000, 1)
    fresh = random_inputs(2, 3, seed=6, device="cuda")
    for static, new in zip((seeds, counters), fresh, strict=True):
        static.copy_(new)
    graph.replay()
    assert torch.equal(out.cpu(), counter_uniform_ref(*(t.cpu() for t in fresh), 3000, 1))


def _interpret_main() -> int:
    """Run as a script under TRITON_INTERPRET=1: the kernel on the CPU vs the reference."""
    from specrun.runtime.kernels.counter_rng_triton import launch_counter_uniform

    failures = 0
    for index, (batch, num_counters, num_elements) in enumerate(CASES):
        seeds, counters = random_inputs(batch, num_counters, seed=index)
        got = launch_counter_uniform(seeds, counters, num_elements, 4)
        if not torch.equal(got, counter_uniform_ref(seeds, counters, num_elements, 4)):
            failures += 1
            print(f"case {CASES[index]}: the kernel's bits differ from the reference")
    return failures


if __name__ == "__main__":
    sys.exit(_interpret_main())
