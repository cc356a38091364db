"""specdec: lossless speculative decoding for LLM generation.

Public API::

    import specdec
    result = specdec.generate("Write a Python function that merges two sorted lists.", max_tokens=128)
    print(result.text, result.stats.mean_accepted_length)
"""

from specdec.api import generate, load_engine, stream
from specdec.engine import Engine
from specdec.output import StreamChunk
from specdec.params import SamplingParams, SpecConfig
from specdec.stats import GenerationStats
from specdec.types import GenerationResult

__version__ = "0.1.0"

__all__ = [
    "Engine",
    "GenerationResult",
    "GenerationStats",
    "SamplingParams",
    "SpecConfig",
    "StreamChunk",
    "generate",
    "load_engine",
    "stream",
]
