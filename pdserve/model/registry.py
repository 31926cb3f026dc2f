"""Which code runs a checkpoint: config.json's `model_type` -> one ModelEntry.

The runner, the dummy-weight builder, the generic loader and the engine bench ask this table for
the model's class, loader and KV cache regions; none of them branches on the model.

To add a model: one package beside deepseek_v3/ and deepseek_v4/ and one line in MODELS. The
package holds, by these names:
  - config.py: `defaults(model_type)` (ModelConfig defaults that differ from its own) and
    `parse(d, model_type, kw, source)` (the ModelConfig fields of config.json `d`, given the
    shared ones already parsed in `kw`);
  - model.py: the causal LM class, `Class(config, tp)`, with the engine's model interface:
    `forward(batch, kv_cache)` -> hidden [T, hidden], `compute_logits(hidden)`,
    `kv_cache_specs(kv_cache_dtype)`, `num_layers`, `config`, `tie_weights()`, and
    `supports_cuda_graphs` when its decode forward never syncs with the host; `supports_mtp`
    with `add_mtp()`, `forward_mtp(batch, kv_cache, prev_hidden)`, `compute_mtp_logits(hidden)`
    when it drafts with its multi-token-prediction layer (its loader then takes `mtp=True`), and
    `mtp_source(hidden)` where the layer pairs tokens with something else than the final hidden
    states (V4: the step's residual streams before hc_head);
  - loader.py: the loader function named in the entry, `(model_dir, dtype, device, tp=,
    quantization=, progress=)` -> the model, and `materialize(model, dtype, device)` (meta
    parameters -> empty ones in their final dtype, as a load allocates them);
  - cache.py: `kv_cache_specs(config, kv_cache_dtype)` (the KV pool's regions) and
    `decode_attention_cost(config, context, itemsize, record_bytes)` (KV values read and
    attention flops of one sequence's decode step: the engine bench's floor).
Modules are imported when first asked for, so parsing a config.json imports no model code.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from pathlib import Path

    import torch
    from torch import nn

    from pdserve.distributed.group import TPGroup
    from pdserve.model.kv_cache import KVRegionSpec


class ParsedConfig(Protocol):
    """A parsed config as the registry sees it (config.py's ModelConfig, which imports this module):
    its model_type picks the entry, the rest goes through to the model's package."""

    model_type: str


@dataclass(frozen=True)
class ModelEntry:
    architecture: str  # the `architectures` name config.json gives (transformers' class name)
    package: str  # the model's package under pdserve.model
    model_class_name: str  # in <package>/model.py
    loader_name: str  # in <package>/loader.py

    def _module(self, name: str) -> Any:
        return importlib.import_module(f"pdserve.model.{self.package}.{name}")

    def config_defaults(self, model_type: str) -> dict[str, Any]:
        return self._module("config").defaults(model_type)

    def parse_config(self, d: dict[str, Any], model_type: str, kw: dict[str, Any], source: str) -> dict[str, Any]:
        return self._module("config").parse(d, model_type, kw, source)

    @property
    def model_class(self) -> type[nn.Module]:
        return getattr(self._module("model"), self.model_class_name)

    def load(
        self, model_dir: str | Path, dtype: torch.dtype, device: torch.device | str, *, tp: TPGroup | None = None,
        quantization: str | None = None, progress: bool = True, fp4_moe_backend: str = "auto", mtp: bool = False,
    ) -> nn.Module:  # fmt: skip
        """The checkpoint in model_dir (quantization: None follows it, "none" dequantizes at load;
        fp4_moe_backend: the kernel path of FP4 experts, engine/config.py; mtp: with its MTP layer,
        for a model class with `supports_mtp`, else ValueError)."""
        load = getattr(self._module("loader"), self.loader_name)
        if mtp and not getattr(self.model_class, "supports_mtp", False):
            raise ValueError(f"speculative method 'mtp' is not yet supported for {self.architecture}")
        return load(
            model_dir,
            dtype,
            device,
            tp=tp,
            quantization=quantization,
            progress=progress,
            fp4_moe_backend=fp4_moe_backend,
            **({"mtp": True} if mtp else {}),
        )

    def materialize(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
        self._module("loader").materialize(model, dtype, device)

    def kv_cache_specs(self, config: ParsedConfig, kv_cache_dtype: str = "auto") -> list[KVRegionSpec]:
        return self._module("cache").kv_cache_specs(config, kv_cache_dtype)

    def decode_attention_cost(
        self, config: ParsedConfig, context: int, itemsize: float, record_bytes: int | None = None
    ) -> tuple[float, int]:
        return self._module("cache").decode_attention_cost(config, context, itemsize, record_bytes)


MODELS: dict[str, ModelEntry] = {
    "deepseek_v3": ModelEntry("DeepseekV3ForCausalLM", "deepseek_v3", "DeepseekForCausalLM", "load_v3_model"),
    "deepseek_v32": ModelEntry("DeepseekV32ForCausalLM", "deepseek_v3", "DeepseekForCausalLM", "load_v3_model"),
    "deepseek_v4": ModelEntry("DeepseekV4ForCausalLM", "deepseek_v4", "DeepseekV4ForCausalLM", "load_v4_model"),
}


def entry(config: ParsedConfig) -> ModelEntry:
    """The entry of a parsed config (its model_type is one of MODELS: the parser checked)."""
    return MODELS[config.model_type]
