"""specrun's public runtime API."""

from .async_engine import AsyncEngine
from .config import EngineConfig, SamplingParams
from .engine import Engine
from .handle import Delta, EngineClosedError, EngineOverloadedError, Output, RequestHandle
from .stats import EngineStats

__all__ = [
    "AsyncEngine",
    "Delta",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "EngineOverloadedError",
    "EngineStats",
    "Output",
    "RequestHandle",
    "SamplingParams",
]
