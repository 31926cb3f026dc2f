"""Load a Hugging Face-format DeepSeek-V3 / V3.2 checkpoint folder into DeepseekForCausalLM.

Layouts: those of model/loader.py's weight_files. Accepted names: those transformers 5.24's
save_pretrained writes and DeepSeek's released checkpoints use (the same scheme: per-expert
`mlp.experts.{e}.{gate,up,down}_proj.weight`), plus transformers' in-memory fused expert names
(`mlp.experts.gate_up_proj` [E, 2I, hidden], `mlp.experts.down_proj` [E, hidden, I]). The MTP
layer (index num_hidden_layers, mtp.py) is loaded with `mtp=True` (speculative decoding's drafts),
in the same formats as the rest; otherwise, as further MTP layers always, it is skipped. FP8 e4m3 weights with `weight_scale_inv` stay
FP8 with their scales in the layers that keep them (model/fp8.py: every projection but kv_b_proj,
and the experts), unless `quantization="none"`; the others (kv_b_proj, or all with "none") are
dequantized at load into the model dtype.

The model is built on the meta device and each parameter is allocated once, directly in its
final dtype and device, then filled from the files. Under tensor parallelism (`tp` of size > 1)
each rank allocates only its shards and fills them with the slices its modules name
(`shard_weight` / `shard_expert`, see model/parallel.py): the full tensor is read, sliced, freed.
"""

from __future__ import annotations

import re
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from pdserve.distributed.group import TPGroup
from pdserve.model.config import ModelConfig
from pdserve.model.deepseek_v3.model import FP32_PARAM_SUFFIXES, DeepseekForCausalLM
from pdserve.model.fp4 import scales_to_float
from pdserve.model.fp8 import FP8, dequantize_block_fp8, is_fp8, model_config_for
from pdserve.model.loader import CheckpointError, weight_files

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(
    r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$"
)
_FUSED_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)(_scale_inv)?$")
_SCALE_SUFFIX = "_scale_inv"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_v3_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    progress: bool = True,
    tp: TPGroup | None = None,
    quantization: str | None = None,
    fp4_moe_backend: str = "auto",
    mtp: bool = False,
) -> DeepseekForCausalLM:
    """quantization: None follows the checkpoint, "none" dequantizes FP8 at load (model/fp8.py);
    fp4_moe_backend: checked, without effect (V3 has no FP4 experts); mtp: load the MTP layer
    too (CheckpointError when the checkpoint has none)."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_model_dir(model_dir)
    if config.v4 is not None:
        raise CheckpointError(
            f"{model_dir} is a deepseek_v4 checkpoint: load it with pdserve.model.deepseek_v4.loader.load_v4_model "
            "(or pdserve.model.loader.load_model, which picks the model's loader)"
        )
    files = weight_files(model_dir)
    if mtp:
        _check_mtp(model_dir, config, files)
    try:
        with torch.device("meta"):
            model = DeepseekForCausalLM(model_config_for(config, quantization, fp4_moe_backend=fp4_moe_backend), tp)
            if mtp:
                model.add_mtp()
    except ValueError as e:  # a quantization that cannot hold, FP8 blocks a shard would cut
        raise CheckpointError(f"{model_dir}: {e}") from e
    materialize(model, dtype, torch.device(device))
    sink = _WeightSink(model)
    layers = config.num_hidden_layers + (1 if mtp else 0)
    names = [n for n in files if not n.endswith(_SCALE_SUFFIX) and not _skipped(n, config, layers)]
    _check_scales(files, config, layers)
    with ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(str(f), framework="pt")) for f in sorted(set(files.values()))}

        def read(name: str) -> torch.Tensor:
            try:
                return handles[files[name]].get_tensor(name)
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"cannot read tensor {name} from {files[name]}: {e}") from e

        for name in tqdm(names, desc=f"Loading {model_dir.name}", unit="tensor", disable=not progress):
            tensor = read(name)
            if sink.keeps_fp8(name, files[name]):
                _check_fp8(name, tensor, files)
                sink.put(name + _SCALE_SUFFIX, scales_to_float(read(name + _SCALE_SUFFIX)), files[name])
            elif is_fp8(tensor):
                tensor = _dequantize(name, tensor, files, read, config)
            sink.put(name, tensor, files[name])
    sink.check_complete(model_dir)
    if mtp:
        model.share_mtp_copies()
    return model.eval()


def _check_mtp(model_dir: Path, config: ModelConfig, files: dict[str, Path]) -> None:
    head = f"model.layers.{config.num_hidden_layers}.eh_proj.weight"
    if config.num_nextn_predict_layers < 1 or head not in files:
        raise CheckpointError(
            f"speculative method 'mtp' needs the checkpoint's MTP layer, and {model_dir} has none "
            f"(config.json num_nextn_predict_layers: {config.num_nextn_predict_layers}, {head} "
            f"{'present' if head in files else 'absent'}); use method 'ngram' with this checkpoint"
        )


def _skipped(name: str, config: ModelConfig, layers: int) -> bool:
    m = _LAYER.match(name)
    if m and int(m.group(1)) >= layers:
        return True  # multi-token-prediction layers not asked for: not part of the base model
    if name == "lm_head.weight" and config.tie_word_embeddings:
        return True
    return name.endswith(_IGNORED_SUFFIXES)


def _check_scales(files: dict[str, Path], config: ModelConfig, layers: int) -> None:
    scales = [n for n in files if n.endswith(_SCALE_SUFFIX) and not _skipped(n, config, layers)]
    if scales and config.quant is None:
        raise CheckpointError(
            f"{scales[0]} in {files[scales[0]]}: scaled (quantized) weights but config.json has no quantization_config"
        )
    for s in scales:
        if s[: -len(_SCALE_SUFFIX)] not in files:
            raise CheckpointError(f"{s} in {files[s]} has no weight {s[: -len(_SCALE_SUFFIX)]}")


def _check_fp8(name: str, tensor: torch.Tensor, files: dict[str, Path]) -> None:
    """A weight its layer keeps FP8 must come as e4m3 with its scales."""
    if not is_fp8(tensor):
        raise CheckpointError(
            f"{name} in {files[name]} is {tensor.dtype}, but config.json's quantization_config makes it an FP8 "
            "weight; load with quantization 'none' to take the weights as they are"
        )
    if name + _SCALE_SUFFIX not in files:
        raise CheckpointError(f"{name} in {files[name]} is {tensor.dtype} but {name + _SCALE_SUFFIX} is missing")


def _dequantize(name, tensor, files, read, config: ModelConfig) -> torch.Tensor:
    if config.quant is None:
        raise CheckpointError(f"{name} in {files[name]} is {tensor.dtype} but config.json has no quantization_config")
    scale_name = name + _SCALE_SUFFIX
    if scale_name not in files:
        raise CheckpointError(f"{name} in {files[name]} is {tensor.dtype} but {scale_name} is missing")
    try:
        return dequantize_block_fp8(tensor, read(scale_name), config.quant.weight_block_size)
    except ValueError as e:
        raise CheckpointError(f"{name} in {files[name]}: {e}") from e


def materialize(model: DeepseekForCausalLM, dtype: torch.dtype, device: torch.device) -> None:
    """Replace every meta parameter by an uninitialized one in its final dtype and device (FP8
    weights and their float32 scales keep theirs)."""
    for mod_name, mod in model.named_modules():
        for pname, p in list(mod._parameters.items()):
            full = f"{mod_name}.{pname}" if mod_name else pname
            if p is None or (full == "lm_head.weight" and model.config.tie_word_embeddings):
                continue
            if p.dtype == FP8 or full.endswith(_SCALE_SUFFIX):
                dt = p.dtype
            else:
                dt = torch.float32 if full.endswith(FP32_PARAM_SUFFIXES) else dtype
            mod._parameters[pname] = nn.Parameter(torch.empty(p.shape, dtype=dt, device=device), requires_grad=False)
    model.tie_weights()


class _WeightSink:
    """Copies checkpoint tensors into the model's parameters and tracks which are still missing.
    Stacked expert parameters are filled per expert (gate rows, then up rows) or whole."""

    def __init__(self, model: DeepseekForCausalLM) -> None:
        self.params = dict(model.named_parameters())
        self.modules = dict(model.named_modules())
        self.tp = model.tp
        self.pending: set[str] = set()
        self.num_experts = model.config.n_routed_experts
        self.inter = model.config.moe_intermediate_size // model.tp.size  # this rank's expert rows
        for name in self.params:
            fused = _FUSED_EXPERT.match(name)
            if fused is None:
                self.pending.add(name)
            else:
                self.pending.update(self._per_expert_names(*fused.groups()))

    def _per_expert_names(self, prefix: str, fused: str, scale: str | None = None) -> list[str]:
        projs = ("gate_proj", "up_proj") if fused == "gate_up_proj" else ("down_proj",)
        leaf = "weight" + (scale or "")
        return [f"{prefix}.{e}.{p}.{leaf}" for e in range(self.num_experts) for p in projs]

    def keeps_fp8(self, name: str, file: Path) -> bool:
        """Whether checkpoint weight `name` lands in an FP8 parameter (with its scales)."""
        return self._target(name, file)[0].dtype == FP8

    def _target(self, name: str, file: Path) -> tuple[torch.Tensor, list[str]]:
        """The destination view for checkpoint tensor `name` and the names it fulfils."""
        m = _EXPERT.match(name)
        if m:
            prefix, e, proj, leaf = m.group(1), int(m.group(2)), m.group(3), m.group(4)
            if e >= self.num_experts:
                raise CheckpointError(
                    f"unexpected tensor {name} in {file}: expert {e} >= n_routed_experts {self.num_experts}"
                )
            suffix = "" if leaf == "weight" else _SCALE_SUFFIX
            if proj == "down_proj":
                return self._param(f"{prefix}.down_proj{suffix}", name, file)[e], [name]
            stacked = self._param(f"{prefix}.gate_up_proj{suffix}", name, file)
            half = stacked.shape[1] // 2  # gate rows (or their scale blocks), then up rows
            rows = slice(0, half) if proj == "gate_proj" else slice(half, 2 * half)
            return stacked[e, rows], [name]
        fused = _FUSED_EXPERT.match(name)
        return self._param(name, name, file), self._per_expert_names(*fused.groups()) if fused else [name]

    def _param(self, pname: str, name: str, file: Path) -> torch.Tensor:
        if pname not in self.params:
            raise CheckpointError(f"unexpected tensor {name} in {file}: no such parameter in this model")
        return self.params[pname]

    def _shard(self, name: str, tensor: torch.Tensor, file: Path) -> torch.Tensor:
        """This rank's slice of a full checkpoint tensor (the tensor itself when replicated)."""
        if self.tp.size == 1:
            return tensor
        m = _EXPERT.match(name)
        owner, pname = (m.group(1), m.group(3)) if m else name.rsplit(".", 1)
        module = self.modules.get(owner)
        shard = getattr(module, "shard_expert" if m else "shard_weight", None)
        try:
            if m:
                return shard(pname, tensor, m.group(4))
            return tensor if shard is None else shard(pname, tensor)
        except ValueError as e:
            raise CheckpointError(f"shape mismatch for {name} in {file}: {e}") from e

    def put(self, name: str, tensor: torch.Tensor, file: Path) -> None:
        dst, fulfils = self._target(name, file)
        tensor = self._shard(name, tensor, file)
        if tuple(dst.shape) != tuple(tensor.shape):
            raise CheckpointError(
                f"shape mismatch for {name} in {file}: expected {tuple(dst.shape)}, got {tuple(tensor.shape)}"
            )
        dst.copy_(tensor)
        self.pending.difference_update(fulfils)

    def check_complete(self, model_dir: Path) -> None:
        if self.pending:
            missing = sorted(self.pending)
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise CheckpointError(f"missing tensor(s) in {model_dir}: {', '.join(missing[:5])}{more}")
