"""`load_format: dummy` (vLLM's name): the model a config.json describes, with random weights made
in memory, no checkpoint read. For benchmarks and memory planning: the tokens mean nothing.

Each parameter is allocated once in its final dtype and device (the loaders' `_materialize`:
the same float32-kept parameters as a real load) and filled from one seeded generator, in
parameter order, so every tensor-parallel rank fills its replicated weights the same way:
  - norm weights 1, norm biases and router score-correction biases 0;
  - matrices N(0, 1 / fan_in) (fan_in = the last dim), so activations keep their scale;
  - other vectors (sinks, hyper-connection bases and scales) N(0, 0.02^2);
  - DeepSeek-V4 hash-routing tables (`tid2eid` [vocab, k]): k distinct random experts a token;
  - weights stored in a low-precision format (FILLERS, keyed by the parameter's dtype): FP8 e4m3
    kept FP8 - the same N(0, 1 / fan_in) values quantized per block as DeepSeek's checkpoints
    were, the scales into `<name>_scale_inv` (filled with their weight, skipped on their own).
    FP4 experts kept FP4 (uint8) - random codes, a power-of-two scale (`fp4.fill_random_fp4_`).
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.distributed.group import TPGroup
from pdserve.model import registry
from pdserve.model.config import ModelConfig
from pdserve.model.fp4 import fill_random_fp4_


def dummy_model(
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str,
    tp: TPGroup | None = None,
    seed: int = 0,
    mtp: bool = False,
) -> nn.Module:
    """The model of `config` (its registry entry's class), random weights; mtp: with its MTP layer."""
    device = torch.device(device)
    entry = registry.entry(config)
    if mtp and not getattr(entry.model_class, "supports_mtp", False):
        raise ValueError(f"speculative method 'mtp' is not yet supported for {entry.architecture}")
    with torch.device("meta"):
        model = entry.model_class(config, tp)
        if mtp:
            model.add_mtp()
    entry.materialize(model, dtype, device)
    fill_random(model, seed)
    return model.eval()


@torch.no_grad()
def fill_random(model: nn.Module, seed: int = 0) -> None:
    """Overwrite every parameter and buffer of `model` in place (rules in the module docstring)."""
    devices = {p.device for p in model.parameters()}
    gens = {d: torch.Generator(device=d).manual_seed(seed) for d in devices}
    for name, p in model.named_parameters():
        if p.dtype in FILLERS:
            FILLERS[p.dtype](model, name, p, gens[p.device])
        elif not name.endswith(SCALE_SUFFIX):
            _fill(name, p, gens[p.device])
    for name, b in model.named_buffers():
        if name.endswith("tid2eid"):  # [vocab, k]: distinct experts per token
            experts = model.config.n_routed_experts
            g = gens.setdefault(b.device, torch.Generator(device=b.device).manual_seed(seed))
            scores = torch.rand(b.shape[0], experts, generator=g, device=b.device)
            b.copy_(scores.topk(b.shape[1], dim=1).indices)


def _fill_fp8(model: nn.Module, name: str, p: torch.Tensor, gen: torch.Generator) -> None:
    """p [..., N, K] e4m3 (a linear weight, or stacked experts) and its `<name>_scale_inv`, from
    N(0, 1 / K) quantized per block of the owning module's fp8_block, a few slices at a time."""
    from pdserve.model import ops

    owner, _, _ = name.rpartition(".")
    block = model.get_submodule(owner).fp8_block
    scale = model.get_parameter(name + SCALE_SUFFIX)
    w, s = p.view(-1, *p.shape[-2:]), scale.view(-1, *scale.shape[-2:])
    step = max(1, 2**27 // (p.shape[-2] * p.shape[-1]))  # slices per draw: <= 512 MB of float32
    for i in range(0, w.shape[0], step):
        vals = torch.empty(w[i : i + step].shape, device=p.device).normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
        q, qs = ops.quant_block_fp8(vals, block)
        w[i : i + step].copy_(q)
        s[i : i + step].copy_(qs)


SCALE_SUFFIX = "_scale_inv"
FILLERS = {  # dtype -> filler(model, name, param, generator)
    torch.float8_e4m3fn: _fill_fp8,
    torch.uint8: lambda model, name, p, gen: fill_random_fp4_(name, p, gen),  # V4's packed experts, their scales
}


def _fill(name: str, p: torch.Tensor, gen: torch.Generator) -> None:
    module, _, leaf = name.rpartition(".")
    is_norm = "norm" in module.rpartition(".")[2]
    if is_norm and leaf == "weight":
        p.fill_(1.0)
    elif (is_norm and leaf == "bias") or leaf == "e_score_correction_bias":
        p.zero_()
    elif p.dim() >= 2:
        p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    else:
        p.normal_(0.0, 0.02, generator=gen)
