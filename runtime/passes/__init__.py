"""FX passes on the post-grad graph, run by one pass manager (see manager.py)."""

from .manager import GraphPass, PassManager, default_passes

__all__ = ["GraphPass", "PassManager", "default_passes"]
