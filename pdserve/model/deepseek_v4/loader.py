"""Load a DeepSeek-V4 checkpoint folder into DeepseekV4ForCausalLM.

Names: transformers' in-memory ones (model.layers.N.self_attn.compressor.kv_proj
.weight, mlp.experts.gate_up_proj [E, 2I, hidden], ...) or DeepSeek's release names
(layers.N.attn.compressor.wkv.weight, layers.N.ffn.experts.E.w1.weight, embed.weight, ...), mapped
by the table below, which follows transformers' deepseek_v4 conversion mapping. Release scales are
`<module>.scale`, transformers' `<module>.weight_scale_inv`.
Dtypes: bf16 / fp16 / fp32 as they are; FP8 e4m3 with 128x128 block scales (float or ue8m0) and
FP4 e2m1 routed experts (two values a byte, one ue8m0 scale per 32 values) kept as they are in
the modules that keep them (`quantization` unset or "fp8": the FP8 projections of model.py's
docstring, scales as float32 `weight_scale_inv`; the experts' bytes and ue8m0 scale bytes copied
into the stacked uint8 parameters of moe.Experts), dequantized at load everywhere else
(`quantization="none"`: everywhere). The MTP layer (`mtp.0.*`, mtp.py) is loaded with `mtp=True`
(speculative decoding's drafts), in the formats of the main layers; otherwise MTP layers (mtp.*, or
layer index >= num_hidden_layers) are skipped, with one log line.
Under tensor parallelism (`tp` of size > 1) each rank allocates only its shards and fills them
with the slices its modules name (`shard_weight` / `shard_expert`, as deepseek_v3/loader.py does):
each full tensor is read (and dequantized), sliced, freed; packed FP4 bytes and their scales are
sliced together (down_proj's I columns: 2 values a byte, 32 a scale).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from tqdm import tqdm

from pdserve.distributed.group import TPGroup
from pdserve.model.config import ModelConfig
from pdserve.model.deepseek_v4.layers import join_rows
from pdserve.model.deepseek_v4.model import FP32_PARAM_PATTERNS, DeepseekV4ForCausalLM
from pdserve.model.fp4 import check_fp4_shapes, dequantize_fp4, is_fp4, packed_bytes, scales_to_float, ue8m0_bytes
from pdserve.model.fp8 import FP8, dequantize_block_fp8, is_fp8, model_config_for
from pdserve.model.loader import CheckpointError, weight_files

log = logging.getLogger(__name__)

# DeepSeek release name -> transformers name, applied in order (regex, replacement).
RELEASE_RENAMES = (
    (r"^(mtp\.\d+)\.norm\.", r"\1.head_norm."), (r"^(mtp\.\d+)\.hc_head_(fn|base|scale)$", r"\1.hc_head.hc_\2"),
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight$", "embed_tokens.weight"), (r"^head\.weight$", "lm_head.weight"),
    (r"^hc_head_fn$", "hc_head.hc_fn"), (r"^hc_head_base$", "hc_head.hc_base"), (r"^hc_head_scale$", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn$", ".attn_hc.fn"), (r"\.hc_attn_base$", ".attn_hc.base"), (r"\.hc_attn_scale$", ".attn_hc.scale"),
    (r"\.hc_ffn_fn$", ".ffn_hc.fn"), (r"\.hc_ffn_base$", ".ffn_hc.base"), (r"\.hc_ffn_scale$", ".ffn_hc.scale"),
    (r"\.attn_sink$", ".sinks"), (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"\.norm\.", ".kv_norm."), (r"\.ape$", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."), (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."), (r"\.gate\.bias$", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."), (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."), (r"(?<!_hc)\.scale$", ".weight_scale_inv"),
)  # fmt: skip
_SCALE = "_scale_inv"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^(model\.(?:layers|mtp)\.\d+\.mlp\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")
_STACKED = (
    "experts.gate_up_proj",
    "experts.down_proj",
    "experts.gate_up_proj_scale_inv",
    "experts.down_proj_scale_inv",
)
_IGNORED = re.compile(r"rotary_emb\.|inv_freq$")
_RELEASE_EXPERT_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def hf_name(name: str) -> str:
    """transformers' in-memory name of checkpoint tensor `name`. Accepts the release's names,
    transformers' in-memory names and what its save_pretrained writes (release names under a
    `model.` prefix: it applies the mapping in reverse), as transformers' loader does: the table
    applies to the name without its `model.` prefix, and leaves in-memory names unchanged."""
    if name.startswith("lm_head."):
        return name
    name = name.removeprefix("model.")
    for pattern, repl in RELEASE_RENAMES:
        name = re.sub(pattern, repl, name)
    return name if name.startswith("lm_head.") else "model." + name


def load_v4_model(
    model_dir: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    tp: TPGroup | None = None,
    quantization: str | None = None,
    progress: bool = True,
    fp4_moe_backend: str = "auto",
    mtp: bool = False,
) -> DeepseekV4ForCausalLM:
    """quantization (--quantization): None follows the checkpoint (FP8 kept FP8, FP4 experts kept
    FP4), "fp8" the same but refuses a checkpoint without an FP8 quantization_config, "none"
    dequantizes everything at load into `dtype`; mtp: load the MTP layer too (CheckpointError
    when the checkpoint has none)."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_model_dir(model_dir)
    if config.v4 is None:
        raise CheckpointError(f"{model_dir} holds a {config.model_type} model, not deepseek_v4")
    files = _readable(model_dir)
    names = {hf_name(n): n for n in files}
    if mtp:
        _check_mtp(model_dir, config, names)
    try:
        with torch.device("meta"):
            model = DeepseekV4ForCausalLM(model_config_for(config, quantization, fp4_moe_backend=fp4_moe_backend), tp)
            if mtp:
                model.add_mtp()
    except ValueError as e:  # a quantization that cannot hold; a shard that would cut a scale block
        raise CheckpointError(f"{model_dir}: {e}") from e
    materialize(model, dtype, torch.device(device))
    skipped = sorted(n for n in names if _is_mtp(n, config) and not (mtp and n.startswith("model.mtp.0.")))
    if skipped:
        log.info("skipping %d MTP tensors (num_nextn_predict_layers=%d): loaded only for "
                 "speculative method 'mtp'", len(skipped), config.v4.num_nextn_predict_layers)  # fmt: skip
    sink = _WeightSink(model)
    with ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(str(f), framework="pt")) for f in sorted(set(files.values()))}

        def read(hf: str) -> torch.Tensor:
            name = names[hf]
            try:
                return handles[files[name]].get_tensor(name)
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"cannot read tensor {name} from {files[name]}: {e}") from e

        for hf in tqdm(sorted(names), desc=f"Loading {model_dir.name}", unit="tensor", disable=not progress):
            if hf.endswith(_SCALE) or _IGNORED.search(hf) or hf in skipped:
                continue
            if hf == "lm_head.weight" and config.tie_word_embeddings:
                continue
            tensor, file = read(hf), files[names[hf]]
            if sink.keeps_fp4(hf):
                sink.put_fp4(hf, lambda: _fp4_expert(hf, tensor, names, file, read), file)
            elif sink.keeps_fp8(hf):
                scale = _fp8_scale(hf, tensor, names, file, read, config)
                sink.put(hf, tensor, file)
                sink.put(hf + _SCALE, scale, file)
            else:
                sink.put(hf, _dequantized(hf, tensor, names, files, read, config), file)
        _check_unused_scales(names, files)
    sink.check_complete(model_dir)
    return model.eval()


def _readable(model_dir: Path) -> dict[str, Path]:
    """weight_files, with unreadable safetensors files reported as CheckpointError."""
    try:
        files = weight_files(model_dir)
        for f in sorted(set(files.values())):
            with safe_open(str(f), framework="pt"):
                pass
    except (OSError, CheckpointError):
        raise
    except Exception as e:  # safetensors' own error types
        raise CheckpointError(f"cannot read the weight files of {model_dir}: {e}") from e
    return files


def _check_mtp(model_dir: Path, config: ModelConfig, names: dict[str, str]) -> None:
    head = "model.mtp.0.e_proj.weight"
    if config.v4.num_nextn_predict_layers < 1 or head not in names:
        raise CheckpointError(
            f"speculative method 'mtp' needs the checkpoint's MTP layer, and {model_dir} has none "
            f"(config.json num_nextn_predict_layers: {config.v4.num_nextn_predict_layers}, mtp.0.e_proj.weight "
            f"{'present' if head in names else 'absent'}); use method 'ngram' with this checkpoint"
        )


def _is_mtp(name: str, config: ModelConfig) -> bool:
    m = _LAYER.match(name)
    return name.startswith("model.mtp.") or (m is not None and int(m.group(1)) >= config.num_hidden_layers)


def _dequantized(hf: str, tensor: torch.Tensor, names, files, read, config: ModelConfig) -> torch.Tensor:
    """The float tensor of checkpoint tensor `hf`: FP8 / FP4 ones are dequantized with their scale."""
    if not (is_fp8(tensor) or is_fp4(tensor)) or hf.endswith("tid2eid"):
        return tensor
    where = f"{names[hf]} in {files[names[hf]].name}"
    if config.quant is None:
        raise CheckpointError(f"{where} is {tensor.dtype} but config.json has no quantization_config")
    scale_name = (hf[: -len(".weight")] if hf.endswith(".weight") else hf) + ".weight" + _SCALE
    if scale_name not in names:
        raise CheckpointError(f"{where} is {tensor.dtype} but its scale ({scale_name} / .scale) is missing")
    scale = read(scale_name)
    try:
        if is_fp8(tensor):
            return dequantize_block_fp8(tensor, scales_to_float(scale), config.quant.weight_block_size)
        return dequantize_fp4(tensor, scale)
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from e


def _fp8_scale(hf: str, tensor: torch.Tensor, names, file: Path, read, config: ModelConfig) -> torch.Tensor:
    """The float32 block scales of a weight the model keeps FP8, checked."""
    where = f"{names[hf]} in {file.name}"
    if not is_fp8(tensor):
        raise CheckpointError(
            f"{where} is {tensor.dtype}, but config.json's quantization_config makes it an FP8 "
            "weight; load with quantization 'none' to take the weights as they are"
        )
    if hf + _SCALE not in names:
        raise CheckpointError(f"{where} is {tensor.dtype} but its scale ({hf + _SCALE} / .scale) is missing")
    scale, (N, K), (bn, bk) = read(hf + _SCALE), tensor.shape, config.quant.weight_block_size
    if tuple(scale.shape) != (-(-N // bn), -(-K // bk)):
        raise CheckpointError(
            f"{where}: weight_scale_inv shape {tuple(scale.shape)} does not fit weight {(N, K)} "
            f"with blocks {(bn, bk)}: expected {(-(-N // bn), -(-K // bk))}"
        )
    return scales_to_float(scale)


def _fp4_expert(hf: str, tensor: torch.Tensor, names, file: Path, read) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed bytes, ue8m0 scale bytes) of an expert the model keeps FP4, checked."""
    where, scale_name = f"{names[hf]} in {file.name}", hf + _SCALE
    if not is_fp4(tensor):
        raise CheckpointError(f"{where} is {tensor.dtype}: FP4 experts kept FP4 need packed e2m1 bytes and a scale")
    if scale_name not in names:
        raise CheckpointError(f"{where} is {tensor.dtype} but its scale ({scale_name} / .scale) is missing")
    scale = read(scale_name)
    try:
        check_fp4_shapes(tensor, scale)
        return packed_bytes(tensor), ue8m0_bytes(scale)
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from e


def _check_unused_scales(names: dict[str, str], files) -> None:
    for hf in names:
        if hf.endswith(_SCALE) and hf[: -len(_SCALE)] not in names and not _IGNORED.search(hf):
            raise CheckpointError(f"{names[hf]} in {files[names[hf]].name} has no weight it scales")


def materialize(model: DeepseekV4ForCausalLM, dtype: torch.dtype, device: torch.device) -> None:
    """Every meta parameter becomes an uninitialized one in its final dtype (float32 for the
    parameters transformers keeps in float32; packed FP4, FP8 and their scales keep theirs) and
    device; buffers keep their dtype. Each group of linears a module names in `joined`
    (projections of one input: a compressor's kv_proj and gate_proj, with a CSA's indexer's and
    its weights_proj; attention's q_a_proj and kv_proj, a CSA layer's q_b_proj and its indexer's;
    a shared expert's gate_proj and up_proj, in bf16 with the router) get their weights (FP8: and
    scales) as row slices of one tensor (`layers.join_rows`), under their own names."""
    for mod_name, mod in model.named_modules():
        for pname, p in list(mod._parameters.items()):
            full = f"{mod_name}.{pname}" if mod_name else pname
            if p is None or (full == "lm_head.weight" and model.config.tie_word_embeddings):
                continue
            if p.dtype in (torch.uint8, FP8) or full.endswith(_SCALE):  # packed FP4, FP8 and their scales
                dt = p.dtype
            else:
                dt = torch.float32 if any(k in full for k in FP32_PARAM_PATTERNS) else dtype
            mod._parameters[pname] = nn.Parameter(torch.empty(p.shape, dtype=dt, device=device), requires_grad=False)
        for bname, b in list(mod._buffers.items()):
            mod._buffers[bname] = torch.zeros(b.shape, dtype=b.dtype, device=device)
    for mod in model.modules():  # projections of one input: rows of one tensor, one GEMM
        for group in getattr(mod, "joined", ()):
            join_rows(*(mod.get_submodule(name) for name in group))
    model.tie_weights()


class _WeightSink:
    """Copies tensors (this rank's slices of them) into parameters / buffers; release per-expert
    w1 / w3 / w2 fill the rows of the stacked gate_up_proj (gate then up) and down_proj, and, for
    FP4 experts kept FP4, their scales the same rows of gate_up_proj_scale_inv / down_proj_scale_inv."""

    def __init__(self, model: DeepseekV4ForCausalLM) -> None:
        self.targets = dict(model.named_parameters())
        self.targets.update(dict(model.named_buffers()))
        self.modules, self.tp, self.fp4 = dict(model.named_modules()), model.tp, model.fp4_experts
        self.num_experts = model.config.n_routed_experts
        self.inter = model.config.moe_intermediate_size // model.tp.size  # this rank's expert rows
        self.pending = {n: None for n in self.targets}  # name -> None (whole) or set of expert parts
        for n, t in self.targets.items():
            if n.endswith(_STACKED):
                self.pending[n] = set(range(t.shape[0] * (2 if "experts.gate_up_proj" in n else 1)))

    def keeps_fp8(self, name: str) -> bool:
        """Whether checkpoint weight `name` lands in an FP8 parameter (with its scales)."""
        return name in self.targets and self.targets[name].dtype == FP8

    def keeps_fp4(self, name: str) -> bool:
        """Whether checkpoint tensor `name` goes in packed (put_fp4) rather than as floats (put)."""
        return self.fp4 and _EXPERT.match(name) is not None

    def put(self, name: str, tensor: torch.Tensor, file: Path) -> None:
        m = _EXPERT.match(name)
        if m:
            target, index, part = self._expert_slot(name, m, file)
        elif name in self.targets:
            target, index, part = name, ..., None
        else:
            raise CheckpointError(f"unexpected tensor {name} in {file}: no such parameter in this model")
        self._copy(name, target, index, part, self._shard(name, tensor, file), file)

    def put_fp4(self, name: str, packed_scale: Callable[[], tuple[torch.Tensor, torch.Tensor]], file: Path) -> None:
        """One expert's packed bytes and ue8m0 scale bytes (release w1 / w3 / w2), read and checked
        by `packed_scale` once the expert is known to be one of the model's."""
        target, index, part = self._expert_slot(name, _EXPERT.match(name), file)
        for suffix, tensor in zip(("", _SCALE), packed_scale()):
            self._copy(name + suffix, target + suffix, index, part, self._shard(name, tensor, file, suffix), file)

    def _expert_slot(self, name: str, m: re.Match, file: Path) -> tuple[str, tuple, int]:
        """(stacked target, index of this expert's rows in it, its part in `pending`)."""
        prefix, e, w = m.group(1), int(m.group(2)), m.group(3)
        if e >= self.num_experts:
            raise CheckpointError(f"unexpected tensor {name} in {file}: expert {e} >= {self.num_experts} experts")
        I = self.inter  # noqa: E741
        rows = slice(None) if w == "w2" else slice(0, I) if w == "w1" else slice(I, 2 * I)
        target = f"{prefix}.down_proj" if w == "w2" else f"{prefix}.gate_up_proj"
        return target, (e, rows), (e if w == "w2" else 2 * e + (w == "w3"))

    def _copy(self, name: str, target: str, index, part: int | None, tensor: torch.Tensor, file: Path) -> None:
        dst = self.targets[target][index]
        if tuple(dst.shape) != tuple(tensor.shape):
            want, got = tuple(dst.shape), tuple(tensor.shape)
            raise CheckpointError(f"shape mismatch for {name} in {file}: expected {want}, got {got}")
        dst.copy_(tensor)
        if part is None or self.pending.get(target) is None:
            self.pending.pop(target, None)
        else:
            self.pending[target].discard(part)
            if not self.pending[target]:
                del self.pending[target]

    def _shard(self, name: str, tensor: torch.Tensor, file: Path, suffix: str = "") -> torch.Tensor:
        """This rank's slice of a full checkpoint tensor (the tensor itself when replicated);
        suffix `_scale_inv`: the scales of a packed FP4 expert `name`."""
        if self.tp.size == 1:
            return tensor
        m = _EXPERT.match(name)
        owner, pname = (m.group(1), _RELEASE_EXPERT_PROJ[m.group(3)]) if m else name.rsplit(".", 1)
        shard = getattr(self.modules.get(owner), "shard_expert" if m else "shard_weight", None)
        try:
            return tensor if shard is None else shard(pname + suffix, tensor)
        except ValueError as e:
            raise CheckpointError(f"shape mismatch for {name + suffix} in {file}: {e}") from e

    def check_complete(self, model_dir: Path) -> None:
        if self.pending:
            missing = sorted(self.pending)
            more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
            raise CheckpointError(f"missing tensor(s) in {model_dir}: {', '.join(missing[:5])}{more}")
