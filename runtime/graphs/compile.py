"""Compile step functions with Inductor and specrun's post-grad passes.

A step is any callable the runtime runs as one graph: a target forward (prefill, verify), a
draft-head forward, a whole speculative round. `compile_step` wraps it in
`torch.compile(fullgraph=True, backend="inductor")` with Inductor's own CUDA graphs off (the
runner captures graphs itself) and independent element-wise kernels combined into one launch,
and, around every call (compilation happens lazily inside calls), installs the pass manager
and bounds recompilation:

- `manager.installed()` patches `post_grad_custom_post_pass` for the duration of the call;
  global config is never modified, so other compilations in the process are unaffected;
- `torch._dynamo.config.patch(recompile_limit=..., fail_on_recompile_limit_hit=True)`: a
  step that keeps recompiling raises instead of silently falling back to eager. Dynamo keeps
  its graphs on the code object, shared by every step made from the same function (each
  Decoder compiles `speculative_round` afresh), so the limit applied is the sum of the limits
  of all steps of that code in the process: one step's graphs never eat another's budget;
- `torch.inference_mode()`: steps are inference only, so a step compiles and runs without
  autograd whatever the caller's grad mode. With grad enabled and weights that require grad,
  AOTAutograd would trace a training graph, write a KV cache's update back outside the
  graph and, when another mutated input is also returned (`KVCache.append` rebinds
  `lengths`), copy the wrong output into the cache (torch 2.11 and 2.13: "The size of tensor
  a (128) must match the size of tensor b (8)"; silently, by broadcasting, at batch 1).

`CompiledStep.num_compiles` counts the graphs compiled for the step on demand (JIT); every
compile past the first is logged as a warning (`TORCH_LOGS=recompiles` prints the guard that
failed). `num_precompiles` counts those compiled ahead of time.

Ahead of time (see artifacts.py): `CompiledStep.aot_compile(*args)` compiles the step for
those arguments exactly as a call would (same options, same passes) with Dynamo's precompile
(`torch.compile(...).aot_compile`), giving a function that can be saved and loaded in another
process; `add_precompiled` hands such loaded functions back to a step, which then runs the
first whose guards pass for a call's arguments and falls back to compiling only when none do.
Inside `precompiling(sink)` that fallback is itself an `aot_compile`, handed to the sink: an
artifact build runs the warm-up so and records every graph (rounds and dynamic prefills).
A precompiled function keeps no guards on the modules it was traced with
(`precompile_guard_filter`): the modules are fixed for the step's lifetime and the artifact's
manifest pins their configs, dtype and device, while rebuilding those guards (one per weight,
submodule and attribute read) was most of a step's load: 1.0-1.6 s for a Llama-3.1-8B round
with them, 0.3-0.6 s without (H200). Guards on the other arguments (state tensors, trees,
sampling flags) are kept: they choose among a step's precompiled functions.

Nothing here knows a model: the helpers only choose a name and whether shapes are dynamic.
"""

from __future__ import annotations

import collections
import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch._dynamo.guards import CheckFunctionManager
from torch._dynamo.types import GuardFilterEntry
from torch._dynamo.utils import counters

from ..passes import PassManager

logger = logging.getLogger(__name__)

DEFAULT_RECOMPILE_LIMIT = 8
# Inductor's own CUDA graphs off (the runner captures them). Independent element-wise kernels
# launched as one (a layer's q and k rotations and its v copy, the draft steps' small
# kernels): a round is hundreds of kernels of a few microseconds each. Element-wise only:
# torch 2.11's Inductor fails to generate a combo kernel holding a sort (the tree's top-k).
# No shape padding: Inductor's pad_mm decides by timing padded against unpadded products
# while compiling (once it judges a product compute-bound, or cannot query the GPU's peak
# rates), so the same step could compile differently from run to run, and an attention's
# matmul padded and sliced back is no longer the SDPA lowering the tree-attention pass
# recognises. The models' dimensions are multiples of 8, and few-row products go to
# rt::skinny_mm.
_INDUCTOR_OPTIONS = {
    "triton.cudagraphs": False,
    "combo_kernels": True,
    "combo_kernels_pointwise_only": True,
    "shape_padding": False,
}

# Graphs allowed per code object: the sum of the recompile limits of its steps (see above).
_code_graph_budgets: collections.Counter[Any] = collections.Counter()


def call_module(module: torch.nn.Module, *args: Any) -> Any:
    """What a step made from a module traces: Dynamo's precompile (`aot_compile`) takes
    functions, and a module passed as an argument is guarded like any other input."""
    return module(*args)


def precompile_guard_filter(entries: Sequence[GuardFilterEntry]) -> list[bool]:
    """Which guards a precompiled function keeps: Dynamo's default for precompile (no guards
    on globals, none of the kinds it cannot serialise) less every guard on a module argument,
    its submodules, parameters and buffers, but for their key-order guards: a serialised
    guard on a module dict's keys needs the modules on its path, or the function fails to
    load."""
    return [_kept_in_precompile(entry) for entry in entries]


def _kept_in_precompile(entry: GuardFilterEntry) -> bool:
    if (
        entry.is_global
        or entry.guard_type in CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES
    ):
        return False
    on_module = entry.orig_guard.source.is_unspecialized_nn_module()
    return not on_module or entry.guard_type == "DICT_KEYS_MATCH"


def _code_of(fn: Callable[..., Any]) -> Any:
    """The code object Dynamo caches `fn`'s graphs on (the callable itself if it has none)."""
    return getattr(fn, "__code__", fn)


class CompiledStep:
    """A step compiled with Inductor under a pass manager; call it like the step itself."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str,
        dynamic: bool,
        manager: PassManager,
        recompile_limit: int,
        options: Mapping[str, Any],
        mark_dynamic: Callable[..., Any] | None = None,
    ) -> None:
        if recompile_limit < 1:
            raise ValueError(f"recompile_limit must be at least 1, not {recompile_limit}")
        self.name = name
        self.manager = manager
        self.recompile_limit = recompile_limit
        # A module becomes the first argument of `call_module`, bound here.
        self._bound: tuple[Any, ...] = (fn,) if isinstance(fn, torch.nn.Module) else ()
        fn = call_module if self._bound else fn
        self._code = _code_of(fn)
        _code_graph_budgets[self._code] += recompile_limit
        self.num_compiles = 0
        self.num_precompiles = 0
        self.num_precompiled_calls = 0
        self._precompiled: list[Any] = []
        self._precompile_sink: Callable[[str, Any], None] | None = None
        self._fn, self._dynamic, self._mark_dynamic = fn, dynamic, mark_dynamic
        self._options = {**_INDUCTOR_OPTIONS, **options}
        self._compiled = self._torch_compile()

    def _torch_compile(self, **options: Any) -> Callable[..., Any]:
        return torch.compile(
            self._fn,
            fullgraph=True,
            dynamic=self._dynamic,
            backend="inductor",
            options={**self._options, **options},
        )

    def aot_compile(self, *args: Any, **kwargs: Any) -> Any:
        """Compile ahead of time for these arguments (Dynamo precompile, experimental in torch
        2.10+); returns a function with `save_compiled_function(path)` and `guard_check`."""
        with torch._dynamo.config.patch(enable_aot_compile=True):
            compiled = self._torch_compile(guard_filter_fn=precompile_guard_filter)
            with self._compiling():
                return compiled.aot_compile(((*self._bound, *args), kwargs))

    @contextlib.contextmanager
    def precompiling(self, sink: Callable[[str, Any], None]) -> Iterator[None]:
        """Within the block, a call that no precompiled function covers is compiled ahead of
        time (`aot_compile` of its arguments) instead of by `torch.compile`, kept for later
        calls, and handed to `sink(name, fn)` with a name unique to this step: each graph is
        compiled once, and a build records every graph its warm-up needs."""
        self._precompile_sink = sink
        try:
            yield
        finally:
            self._precompile_sink = None

    def add_precompiled(self, fns: Sequence[Any]) -> None:
        """Loaded precompiled functions of this step (guard checks disabled on them: the step
        checks each one's guards itself before calling it)."""
        self._precompiled.extend(fns)

    @torch.inference_mode()
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Precompiled functions were loaded under inference mode (artifacts.py): their guards
        # hold for calls made under it, as every call is (the decorator above).
        traced_args = (*self._bound, *args)
        for fn in self._precompiled:
            if fn.guard_check(*traced_args, **kwargs):
                self.num_precompiled_calls += 1
                return fn(*traced_args, **kwargs)
        # Dims are marked dynamic only for a compile: a precompiled function loaded in another
        # process refuses (guards) tensors that carry marks.
        if self._mark_dynamic is not None:
            self._mark_dynamic(*args)
        if self._precompile_sink is not None:
            fn = self.aot_compile(*args, **kwargs)
            self._precompile_sink(f"{self.name}-{self.num_precompiles}", fn)
            self.num_precompiles += 1
            self._precompiled.append(fn)
            return fn(*traced_args, **kwargs)
        num_graphs = counters["stats"]["unique_graphs"]
        with self._compiling():
            out = self._compiled(*traced_args, **kwargs)
        num_new = counters["stats"]["unique_graphs"] - num_graphs
        if num_new:
            self._record_compiles(num_new)
        return out

    @contextlib.contextmanager
    def _compiling(self) -> Iterator[None]:
        with (
            torch.inference_mode(),
            self.manager.installed(),
            # Python floats are constants (scales, eps): Dynamo's precompile cannot restart an
            # analysis that tried to trace one of a dynamic step's floats symbolically.
            torch._dynamo.config.patch(
                recompile_limit=_code_graph_budgets[self._code],
                fail_on_recompile_limit_hit=True,
                specialize_float=True,
            ),
        ):
            yield

    def _record_compiles(self, num_new: int) -> None:
        self.num_compiles += num_new
        if self.num_compiles == num_new:
            logger.info("step %s compiled (passes: %s)", self.name, dict(self.manager.stats))
        else:
            logger.warning(
                "step %s recompiled: %d graphs so far (limit %d); TORCH_LOGS=recompiles "
                "shows the guard that failed",
                self.name,
                self.num_compiles,
                self.recompile_limit,
            )


def compile_step(
    fn: Callable[..., Any],
    *,
    name: str,
    dynamic: bool = False,
    manager: PassManager | None = None,
    recompile_limit: int = DEFAULT_RECOMPILE_LIMIT,
    options: Mapping[str, Any] | None = None,
    mark_dynamic: Callable[..., Any] | None = None,
) -> CompiledStep:
    """Compile `fn` (a function or module) as one graph with Inductor and the passes.

    Args:
        fn: the step; it must trace without graph breaks (fullgraph=True).
        name: what logs call the step.
        dynamic: compile for symbolic shapes (True) or specialise on the first shapes seen.
        manager: the pass manager (a fresh `PassManager()` with specrun's passes by default);
            its `stats` count the matches of every graph this step compiles.
        recompile_limit: compiled graphs allowed per step before a call raises.
        options: extra Inductor options (on top of `_INDUCTOR_OPTIONS`).
        mark_dynamic: called with a call's arguments before they are compiled for (not when
            a precompiled function takes them), to mark dims dynamic.
    """
    return CompiledStep(
        fn,
        name=name,
        dynamic=dynamic,
        manager=PassManager() if manager is None else manager,
        recompile_limit=recompile_limit,
        options=options or {},
        mark_dynamic=mark_dynamic,
    )


def compile_prefill(
    forward: Callable[..., Any], *, name: str = "prefill", **kwargs: Any
) -> CompiledStep:
    """A prompt forward: shapes dynamic (prompt lengths vary)."""
    return compile_step(forward, name=name, dynamic=True, **kwargs)


def compile_verify(forward: Callable[..., Any], **kwargs: Any) -> CompiledStep:
    """A tree-verification forward of the target: static shapes per (batch, tree) bucket."""
    return compile_step(forward, name="verify", **kwargs)


def compile_draft(forward: Callable[..., Any], **kwargs: Any) -> CompiledStep:
    """A draft-head forward: static shapes."""
    return compile_step(forward, name="draft", **kwargs)


def compile_round(round_fn: Callable[..., Any], **kwargs: Any) -> CompiledStep:
    """A whole speculative round (draft, verify, accept, commit): static shapes."""
    return compile_step(round_fn, name="round", **kwargs)
