"""Stop strings, checked on the host: text is released as it is decoded, but for a tail that
could still grow into a stop string, and is cut exactly before the first stop string."""

from __future__ import annotations

from collections.abc import Sequence


class StopStrings:
    """Feed text deltas in order; each call returns (text safe to send, whether a stop string
    was found). After a match the caller ends the request and sends nothing more."""

    def __init__(self, stops: Sequence[str]) -> None:
        self._stops = list(stops)
        self._held = ""

    def feed(self, text: str) -> tuple[str, bool]:
        if not self._stops:
            return text, False
        held = self._held + text
        found = [index for stop in self._stops if (index := held.find(stop)) >= 0]
        if found:
            self._held = ""
            return held[: min(found)], True
        keep = max((self._partial(held, stop) for stop in self._stops), default=0)
        self._held = held[len(held) - keep :] if keep else ""
        return held[: len(held) - keep], False

    def flush(self) -> str:
        """What was held back when the request ends without a stop string."""
        held, self._held = self._held, ""
        return held

    @staticmethod
    def _partial(text: str, stop: str) -> int:
        """The longest suffix of `text` that is a proper prefix of `stop`."""
        for size in range(min(len(text), len(stop) - 1), 0, -1):
            if text.endswith(stop[:size]):
                return size
        return 0
