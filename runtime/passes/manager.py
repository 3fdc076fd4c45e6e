"""The pass manager: the one custom pass Inductor runs on every post-grad graph we compile.

`PassManager` is a `CustomGraphPass` holding our graph passes in order. Installed as
Inductor's `post_grad_custom_post_pass` (only ever through `manager.installed()`, a
`torch._inductor.config.patch` around compilation, never by setting global config), it runs
each pass on the functional, decomposed ATen graph after Inductor's own post-grad passes,
removes what a pass left dead, and adds the pass's match count to `stats[pass.name]`.

Counting: `stats` accumulates over every graph compiled while the manager is installed until
`reset()`. A graph served from Inductor's FX graph cache or AOTAutograd's cache is not
compiled, so its matches are not counted again; tests that assert counts disable both caches.

`uuid()` makes the FX graph cache correct: it hashes every source file of runtime/passes and
of each pass, with each pass's name and `version`, so editing a pass or a matcher it uses (or
changing the list) changes the key and stale compiled graphs are never reused.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import fx
from torch._inductor.custom_graph_pass import CustomGraphPass

logger = logging.getLogger(__name__)


class GraphPass:
    """One fusion family. Subclasses set `name` (the stats key) and `version` (bump it when
    behaviour changes without the source file changing) and implement `__call__`, which
    rewrites the graph in place and returns the number of matches it replaced."""

    name: str = ""
    version: int = 1

    def __call__(self, graph: fx.Graph) -> int:
        raise NotImplementedError

    def options(self) -> dict[str, object]:
        """The constructor's options, part of the manager's cache key: a pass built with
        other options rewrites graphs differently."""
        return {}

    def source_files(self) -> tuple[str, ...]:
        """Files whose content defines this pass beyond runtime/passes (all of which the
        manager hashes anyway): by default the files of its classes."""
        return tuple(
            inspect.getfile(cls) for cls in type(self).__mro__ if cls not in (GraphPass, object)
        )


class PassManager(CustomGraphPass):
    """Runs `passes` in order on each post-grad graph and counts their matches."""

    def __init__(self, passes: Sequence[GraphPass] | None = None) -> None:
        self.passes = list(default_passes() if passes is None else passes)
        names = [p.name for p in self.passes]
        if len(set(names)) != len(names) or not all(names):
            raise ValueError(f"passes need distinct, non-empty names, got {names}")
        self.stats: Counter[str] = Counter()
        self.num_graphs = 0

    def __call__(self, graph: fx.Graph) -> None:
        self.num_graphs += 1
        for graph_pass in self.passes:
            num_matches = graph_pass(graph)
            self.stats[graph_pass.name] += num_matches
            if num_matches:
                graph.eliminate_dead_code()
                logger.info("pass %s: %d matches", graph_pass.name, num_matches)
        graph.lint()

    def uuid(self) -> str:
        files = {str(path) for path in Path(__file__).parent.glob("*.py")}
        for graph_pass in self.passes:
            files.update(graph_pass.source_files())
        keys = [f"{p.name}@{p.version}:{sorted(p.options().items())}" for p in self.passes]
        hasher = hashlib.sha256(";".join(keys).encode())
        # Read the files on every call (Inductor's get_hash_for_files caches by path).
        for path in sorted(files):
            hasher.update(Path(path).read_bytes())
        return hasher.hexdigest()

    def reset(self) -> None:
        """Forget the counts (`stats`, `num_graphs`)."""
        self.stats.clear()
        self.num_graphs = 0

    @contextlib.contextmanager
    def installed(self) -> Iterator[PassManager]:
        """Inductor runs this manager on the post-grad graphs it compiles inside the block."""
        with torch._inductor.config.patch(post_grad_custom_post_pass=self):
            yield self


def default_passes() -> list[GraphPass]:
    """specrun's passes, in the order they run."""
    from .mm_silu_mul import SiluMulFusion
    from .rms_norm_mm import NormPrologueFusion
    from .skinny_mm import SkinnyMMReplacement
    from .topk import SmallTopkReplacement
    from .tree_attention import TreeAttentionFusion

    # The SiLU fusion takes the products the skinny-mm pass made; the norm fusion both.
    return [
        TreeAttentionFusion(),
        SmallTopkReplacement(),
        SkinnyMMReplacement(),
        SiluMulFusion(),
        NormPrologueFusion(),
    ]
