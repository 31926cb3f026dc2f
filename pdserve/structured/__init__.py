"""Structured outputs (a JSON schema, any JSON object, a regex, a choice, a grammar) through
llguidance: SamplingParams.structured_outputs compiled once per spec against the tokenizer, a
matcher per request, the token mask applied in the sampler.

    compiler.py  the spec -> llguidance grammar, compiled and cached per tokenizer; check() (no torch)
    matcher.py   one request's grammar state, advanced by its output tokens (no torch)
    bitmask.py   a step's masks: filled on the host, applied to the logits on the device

`check(params, tokenizer)` raises ValueError naming what the library rejects: the router's 400.
Importing this package does not import torch.
"""

from pdserve.structured.compiler import check, compiler_for

__all__ = ["check", "compiler_for"]
