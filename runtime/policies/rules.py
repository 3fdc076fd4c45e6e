"""The policies that follow a fixed rule instead of a cost model: `fixed`, `batch-table`
(TensorRT-LLM's cut-off), `ema` (SGLang's moving average) and `gammatune`."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import ClassVar

from .base import Policy, nearest_depth, plain_or_first, speculative_candidates

WINDOW, CUTOFF = 256, 0.5
EMA_RATE = 0.2


class FixedPolicy(Policy):
    name = "fixed"

    def choose(self, bucket, candidates, requests, costs):
        return candidates[0]

    @property
    def adaptive(self) -> bool:
        return False


class BatchTablePolicy(Policy):
    name = "batch-table"

    def __init__(self) -> None:
        self._window: deque[int] = deque(maxlen=WINDOW)
        self.switched_off = False

    def choose(self, bucket, candidates, requests, costs):
        if self.switched_off:
            return plain_or_first(candidates)
        return candidates[0]

    def observe(self, bucket, candidate, accepted):
        if candidate.tree is None or self.switched_off:
            return
        self._window.extend(accepted)
        full = len(self._window) == self._window.maxlen
        if full and sum(self._window) / len(self._window) < CUTOFF:
            self.switched_off = True


class _DepthPolicy(Policy):
    """A policy that follows a target depth learnt from the accepted lengths of speculative
    rounds: the tree nearest it (`ABOVE`: the shallowest at least that deep); the configured
    tree until it has one; never plain."""

    ABOVE: ClassVar[bool]

    def __init__(self) -> None:
        self._state: float | None = None

    def _target(self, state: float) -> float:
        return state

    def _learn(self, state: float | None, depth: int, accepted: Sequence[int]) -> float:
        """The state after a round of a tree of `depth` whose rows accepted `accepted`."""
        raise NotImplementedError

    def choose(self, bucket, candidates, requests, costs):
        speculative = speculative_candidates(candidates) or list(candidates)
        if self._state is None:
            return speculative[0]
        return nearest_depth(speculative, self._target(self._state), above=self.ABOVE)

    def observe(self, bucket, candidate, accepted):
        if candidate.tree is None or not accepted:
            return
        self._state = self._learn(self._state, candidate.tree.depth, accepted)


class EmaPolicy(_DepthPolicy):
    """State: a moving average of the accepted drafts; target one level deeper."""

    name = "ema"
    ABOVE = True

    def _target(self, state: float) -> float:
        return math.ceil(state) + 1

    def _learn(self, state, depth, accepted):
        mean = sum(accepted) / len(accepted)
        return mean if state is None else (1 - EMA_RATE) * state + EMA_RATE * mean


class GammaTunePolicy(_DepthPolicy):
    """State: the target depth gamma."""

    name = "gammatune"
    ABOVE = False

    def _learn(self, state, depth, accepted):
        gamma = depth if state is None else state
        if min(accepted) >= depth:
            return gamma + 1
        return max(1.0, (gamma + sum(accepted) / len(accepted)) / 2)
