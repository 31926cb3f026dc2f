"""pdserve: prefill-decode disaggregated serving for DeepSeek-style models.

`from pdserve import LLM, SamplingParams` - the offline API, in vLLM's shapes. Exports load
lazily, so importing a submodule (e.g. pdserve.disagg.base in the router) does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "pdserve.llm",
    "SamplingParams": "pdserve.sampling_params",
    "RequestOutput": "pdserve.outputs",
    "CompletionOutput": "pdserve.outputs",
}

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]

if TYPE_CHECKING:
    from pdserve.llm import LLM
    from pdserve.outputs import CompletionOutput, RequestOutput
    from pdserve.sampling_params import SamplingParams


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
