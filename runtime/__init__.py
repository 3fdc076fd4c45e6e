"""specrun's public runtime API."""

from .config import EngineConfig, SamplingParams
from .engine import Engine, EngineStats, Output

__all__ = ["Engine", "EngineConfig", "EngineStats", "Output", "SamplingParams"]
