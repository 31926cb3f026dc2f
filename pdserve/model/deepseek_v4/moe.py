"""DeepSeek-V4 MoE: routed experts (learned top-k or hash-routed) plus one shared expert.

Legend: T tokens, E routed experts, k experts per token, I moe_intermediate_size.

scores = sqrtsoftplus(x W_g^T) (or sigmoid). A routed ("moe") layer picks the top-k of
scores + e_score_correction_bias (the bias only selects); a "hash_moe" layer takes the k experts
of a frozen table tid2eid[token id]. The weights are the chosen unbiased scores, normalized to
sum 1, times routed_scaling_factor. Experts and the shared expert are SwiGLU with
swiglu_limit: gate clamped to <= limit, up to [-limit, limit]. Experts are stacked as transformers
holds them: gate_up_proj [E, 2I, hidden] (gate rows, then up rows), down_proj [E, hidden, I];
FP4 checkpoints' experts (V4-Flash's) stay FP4 on the device (`Experts`, `fp4_experts`).

Tensor parallelism splits I, as V3's MoE does (deepseek_v3/moe.py; I below is this rank's I/tp): every rank
holds every expert's slice of the intermediate dim, and the shared expert's (gate / up
column-parallel, down row-parallel). SwiGLU and its clamps act element by element on I, so each
rank's routed and shared outputs are partial sums that leave with one all-reduce. The router and
the hash table are replicated: every rank picks the same experts from the same input.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.distributed.group import TPGroup
from pdserve.model import ops
from pdserve.model.config import ModelConfig
from pdserve.model.deepseek_v4.layers import joined_outputs, joined_weights
from pdserve.model.fp4 import FP4_BLOCK, frag_experts
from pdserve.model.fp8 import Block
from pdserve.model.parallel import ColumnParallelLinear, RowParallelLinear, shard_expert, shard_stacked_experts


def fp4_experts(config: ModelConfig) -> bool:
    """Whether the routed experts stay FP4: the checkpoint ships them so (V4-Flash does) and the
    config the model is built from keeps its quantization (`quant`; None: dequantized at load)."""
    return config.quant is not None and config.quant.expert_dtype == "fp4"


class Router(nn.Module):
    """weight [E, hidden]; e_score_correction_bias [E] (routed) or tid2eid [vocab, k] (hash)."""

    def __init__(self, config: ModelConfig, hashed: bool) -> None:
        super().__init__()
        E, self.top_k, self.hashed = config.n_routed_experts, config.num_experts_per_tok, hashed
        self.scaling, self.scoring = config.routed_scaling_factor, config.v4.scoring_func
        self.weight = nn.Parameter(torch.zeros(E, config.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(config.vocab_size, self.top_k, dtype=torch.int64))
        else:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(E, dtype=torch.float32))  # kept float32

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden], input_ids [T] -> weights [T, k], expert ids [T, k]."""
        return self.route(F.linear(x, self.weight), input_ids)

    def route(self, logits: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [T, E] (rows may be strided: a joined GEMM's) -> weights [T, k], expert ids [T, k]."""
        if self.hashed:  # scoring, top-k or hash rows, normalization: one kernel on a GPU
            return ops.route(logits, self.top_k, self.scoring, self.scaling, table=self.tid2eid, input_ids=input_ids)
        bias = self.e_score_correction_bias
        return ops.route(logits, self.top_k, self.scoring, self.scaling, bias=bias)


class Experts(nn.Module):
    """Routed experts: gate_up_proj [E, 2I, hidden] and down_proj [E, hidden, I] in the model's
    dtype, or, kept FP4 (`fp4_experts`), the checkpoint's packed e2m1 bytes with their ue8m0 scales
    (model/fp4.py: two values a byte, one scale per 32 along K): gate_up_proj [E, 2I, hidden/2],
    gate_up_proj_scale_inv [E, 2I, ceil(hidden/32)], down_proj [E, hidden, I/2],
    down_proj_scale_inv [E, hidden, ceil(I/32)], all uint8, read by ops.fused_moe_fp4 (the Triton
    kernel on CUDA, which dequantizes in registers; the torch reference elsewhere). On CUDA the
    first forward (the engine's eager warm-up, before any graph capture) re-lays them once into
    the kernel's fragment layout (`fp4.frag_experts`) and frees the checkpoint layout, unless the engine's
    fp4_moe_backend picks MXFP8 activations (`ops.fp4_moe_mxfp8`): that kernel reads the checkpoint layout.
    Under TP, down_proj's I columns split: a rank's share must hold whole 32-value scale groups."""

    def __init__(self, config: ModelConfig, tp: TPGroup) -> None:
        super().__init__()
        E, hidden = config.n_routed_experts, config.hidden_size
        self.size, self.limit, self.fp4 = tp.size, config.v4.swiglu_limit, fp4_experts(config)
        self.fp4_backend = config.quant.fp4_moe_backend if self.fp4 else None  # ops.fp4_moe_mxfp8
        self.start, I = tp.shard(config.moe_intermediate_size, "moe_intermediate_size")
        self.inter = I  # this rank's share
        if not self.fp4:
            self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * I, hidden))
            self.down_proj = nn.Parameter(torch.zeros(E, hidden, I))
            return
        if hidden % 2 or I % 2 or (tp.size > 1 and I % FP4_BLOCK):
            raise ValueError(
                f"FP4 experts: hidden_size {hidden} and moe_intermediate_size {config.moe_intermediate_size} "
                f"over tensor_parallel_size {tp.size} ({I} a rank) must be even, and a rank's share a "
                f"multiple of the {FP4_BLOCK}-value scale group (a shard may not cut one): choose another "
                f"tensor_parallel_size, or --quantization none to dequantize the experts at load"
            )

        def packed(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.zeros(*shape, dtype=torch.uint8), requires_grad=False)

        self.tiles: tuple[torch.Tensor, ...] | None = None  # (w13, w2, w13_scale, w2_scale) re-laid, once on CUDA
        groups = -(-hidden // FP4_BLOCK), -(-I // FP4_BLOCK)
        self.gate_up_proj, self.gate_up_proj_scale_inv = packed(E, 2 * I, hidden // 2), packed(E, 2 * I, groups[0])
        self.down_proj, self.down_proj_scale_inv = packed(E, hidden, I // 2), packed(E, hidden, groups[1])

    def _cols(self, proj: str) -> tuple[int, int]:
        """(start, n) of this rank's down_proj columns: values, packed bytes (2 values) or scales (32)."""
        per = FP4_BLOCK if proj.endswith("_scale_inv") else 2 if self.fp4 else 1
        return self.start // per, self.inter // per

    def shard_expert(self, proj: str, full: torch.Tensor) -> torch.Tensor:
        """One expert's checkpoint tensor -> this rank's slice of I: gate/up rows [I, ...], down_proj
        columns; `proj` is gate_proj / up_proj / down_proj, with `_scale_inv` for an FP4 scale."""
        start, n = self._cols(proj) if proj.startswith("down_proj") else (self.start, self.inter)
        return shard_expert(proj.removesuffix("_scale_inv"), full, start, n, self.size)

    def shard_weight(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """Stacked tensors: gate_up_proj [E, 2I, ...] (gate rows, then up rows), down_proj [E, hidden, I...]."""
        if name.startswith("down_proj"):
            return shard_stacked_experts("down_proj", full, *self._cols(name), self.size)
        return shard_stacked_experts("gate_up_proj", full, self.start, self.inter, self.size)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], weights/ids [T, k] -> [T, hidden] (this rank's partial sum under TP)."""
        if self.fp4:
            if ops.fp4_moe_mxfp8(self.fp4_backend, x):  # the checkpoint layout, never tiled
                w = self.gate_up_proj, self.down_proj, self.gate_up_proj_scale_inv, self.down_proj_scale_inv
                return ops.fused_moe_fp4(x, *w, weights, ids, swiglu_limit=self.limit, mxfp8=True)
            if x.is_cuda and self.tiles is None:
                self._tile()
            if self.tiles:
                return ops.fused_moe_fp4(x, *self.tiles, weights, ids, swiglu_limit=self.limit)
            w = self.gate_up_proj, self.down_proj, self.gate_up_proj_scale_inv, self.down_proj_scale_inv
            return ops.fused_moe_fp4(x, *w, weights, ids, swiglu_limit=self.limit)
        # one fused kernel on CUDA (no host sync: CUDA graphs can capture it), the reference elsewhere
        return ops.fused_moe(x, self.gate_up_proj, self.down_proj, weights, ids, swiglu_limit=self.limit)

    @torch.no_grad()
    def _tile(self) -> None:
        """Checkpoint layout -> the kernel's fragment layout (once, outside graph capture); the
        packed parameters are emptied. Scales over 2 keep the checkpoint layout (and its kernel)."""
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("FP4 experts are re-laid on their first CUDA forward: run one eagerly before capture")
        w = self.gate_up_proj, self.down_proj, self.gate_up_proj_scale_inv, self.down_proj_scale_inv
        frag = frag_experts(*w)
        if frag is None:
            self.tiles = ()  # falsy: keep the checkpoint layout, do not try again
            return
        # buffers (not in the state dict): what the model holds, as bench-engine's floor counts it
        for name, t in zip(("w13_tiles", "w2_tiles", "w13_tile_scales", "w2_tile_scales"), frag):
            self.register_buffer(name, t, persistent=False)
        self.tiles = (self.w13_tiles, self.w2_tiles, self.w13_tile_scales, self.w2_tile_scales)
        for name in ("gate_up_proj", "down_proj", "gate_up_proj_scale_inv", "down_proj_scale_inv"):
            getattr(self, name).data = torch.empty(0, dtype=torch.uint8, device=self.tiles[0].device)


class SharedExpert(nn.Module):
    """Under TP: intermediate dim split, output a partial sum (no all-reduce of its own). FP8
    (`fp8_block`) as the checkpoint ships it: gate, up and the clamped SwiGLU are one GEMV at
    decode rows (`ops.fp8_swiglu`). The loader joins the gate and up rows (`joined`): past the
    GEMV's rows, and in bf16, one GEMM runs both, then the SwiGLU kernel on its two halves."""

    joined = (("gate_proj", "up_proj"),)  # groups of linears whose weights share one tensor

    def __init__(self, hidden: int, inter: int, limit: float, tp: TPGroup, fp8_block: Block | None = None) -> None:
        super().__init__()
        self.limit, what = limit, "moe_intermediate_size"
        self.gate_proj = ColumnParallelLinear(hidden, inter, tp, what=what, fp8_block=fp8_block)
        self.up_proj = ColumnParallelLinear(hidden, inter, tp, what=what, fp8_block=fp8_block)
        self.down_proj = RowParallelLinear(inter, hidden, tp, reduce=False, what=what, fp8_block=fp8_block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(x))

    def act(self, x: torch.Tensor) -> torch.Tensor:
        """swiglu(gate_proj(x), up_proj(x)) [T, I] (this rank's I)."""
        gate, up = self.gate_proj, self.up_proj
        if gate.fp8_block is not None:  # the joined rows (if any) serve the GEMM path past the GEMV's rows
            w = (gate.weight, gate.weight_scale_inv), (up.weight, up.weight_scale_inv)
            return ops.fp8_swiglu(x, *w, self.limit, gate.fp8_block, joined=joined_weights(gate, up))
        return ops.swiglu(*joined_outputs(x, gate, up), self.limit)


class V4MoE(nn.Module):
    """gate (Router), experts, shared_experts: the checkpoint's names under `mlp.`. The router and
    the shared expert read the same x: with weights of one dtype (bf16; not FP8 shared experts)
    the loader joins their rows (`joined`) and one GEMM gives the logits, gate and up."""

    joined = (("gate", "shared_experts.gate_proj", "shared_experts.up_proj"),)

    def __init__(self, config: ModelConfig, layer_idx: int, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp or TPGroup.single()
        self.gate = Router(config, hashed=config.v4.mlp_layer_types[layer_idx] == "hash_moe")
        self.experts = Experts(config, self.tp)
        # one shared expert of width I, whatever n_shared_experts says (as transformers builds it)
        inter, limit = config.moe_intermediate_size, config.v4.swiglu_limit
        self.shared_experts = SharedExpert(config.hidden_size, inter, limit, self.tp, config.fp8_block)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        routed, shared = self.parts(x, input_ids)
        return self.tp.all_reduce(routed + shared)  # [T, hidden]

    def parts(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The routed and the shared experts' outputs [T, hidden] (this rank's partial sums under
        TP), for a caller that adds them itself (one TP rank: in hc_post's kernel)."""
        shared = self.shared_experts
        linears = self.gate, shared.gate_proj, shared.up_proj
        if joined_weights(*linears) is None:
            weights, ids = self.gate(x, input_ids)
            return self.experts(x, weights, ids), shared(x)
        logits, gate, up = joined_outputs(x, *linears)
        weights, ids = self.gate.route(logits, input_ids)
        return self.experts(x, weights, ids), shared.down_proj(ops.swiglu(gate, up, shared.limit))
