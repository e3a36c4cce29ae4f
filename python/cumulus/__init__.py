"""cumulus: adaptive sparse attention for long-context LLM inference, from Python.

- ``cumulus.Model``: a model file, its tokenizer, and ``generate`` with any decode method.
- ``cumulus.Decoder``: one decode method over a paged KV cache it owns, on arrays
  (numpy, torch CPU tensors; read in place through DLPack or the buffer protocol).
- ``cumulus.methods()``: the registry, with every parameter's type, default and range.
- ``cumulus.transformers`` (import it; needs torch and transformers): any decode method inside
  a Hugging Face transformers model, through its ``AttentionInterface`` and a ``Cache``.
- ``cumulus.Error``: what every bad input raises (a ValueError and a RuntimeError) with the
  C++ library's message.

docs/python.md is the reference.
"""

from ._cumulus import (
    DecodeStats,
    Decoder,
    GenerateResult,
    GenerateStats,
    Method,
    Model,
    Param,
    has_cuda,
    methods,
    simd_target,
)
from ._errors import Error

__all__ = [
    "DecodeStats",
    "Decoder",
    "Error",
    "GenerateResult",
    "GenerateStats",
    "Method",
    "Model",
    "Param",
    "has_cuda",
    "methods",
    "simd_target",
]
