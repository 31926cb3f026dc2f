"""Tile configurations for the decode kernels, sm_90 (H100/H200) and sm_120 (RTX PRO 6000)
side by side, with the shared-memory estimate each sm_120 entry is checked against (tests).

An sm_120 block gets at most 99 KB of shared memory (101376 bytes opt-in), an sm_90 block
227 KB. The estimate counts what Triton keeps in shared memory for these kernels: one buffer per
pipeline stage for every tile loaded in the loop, the dot operands it stages (q, the probability
tile), and a layout-conversion scratch tile; it is deliberately on the high side.
The sm_90 entries are the fastest of the sweeps in `benchmarks/kernels/` (results in
docs/kernels.md); the sm_120 entries are the largest tiles whose estimate fits, compiled for that
card (scripts/check_sm120_configs.py) but not timed on it.

Legend: H heads, BH heads per program, BN KV rows (or candidates) per tile, BV/BT padded value and
tail (rope) dims, BM/BN/BK GEMM tile, E experts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

SMEM_LIMIT = {90: 232448, 120: 101376}  # bytes per block, opt-in maximum
CPU = 0  # the interpreter: small tiles so that loops, masks and splits are all exercised


@dataclass(frozen=True)
class MLAConfig:
    block_h: int  # heads per program: the M dimension of both dots
    block_n: int  # gathered KV rows per tile
    num_warps: int
    num_stages: int
    waves: int = 2  # programs aimed for per multiprocessor when choosing the split count
    min_tiles: int = 2  # fewest KV tiles per split
    max_splits: int = 0  # most splits per query (0: no cap)
    # merge the splits in the split kernel (the last program to arrive) instead of a second
    # launch: slower on sm_90 at every benchmarked shape (docs/kernels.md), so off
    fused_merge: bool = False


@dataclass(frozen=True)
class MoEConfig:
    block_m: int  # sorted (token, expert) rows per tile
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    block_n2: int = 0  # BN of the w2 kernel (0: block_n)
    # FP4 MoE only: `tl.dot_scaled` (the compiler upcasts e2m1) instead of the register dequant
    dot_scaled: bool = False
    split_k: int = 0  # FP4 MoE only: K splits per GEMM (0: from the SM count when the grid is small)

    @property
    def w2_block_n(self) -> int:
        return self.block_n2 or self.block_n


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int
    block_n: int
    block_k: int  # capped at the weight block's bk (one scale per K step)
    num_warps: int
    num_stages: int
    fp8_act: bool = False  # quantize x per 128 values and dot in e4m3 (bf16 / fp16 x only)
    split_k: bool = True  # split K when the output tiles alone are fewer than the multiprocessors
    waves: int = 2  # programs aimed for per multiprocessor when splitting K
    dequant: bool = False  # large M: dequantize the weight to x's dtype, then a torch (cuBLAS) matmul


@dataclass(frozen=True)
class Fp8GemvConfig:
    """The FP8 GEMV (fp8_gemv.py): one M tile, BN weight rows a program over a range of K steps."""

    block_n: int  # weight rows a program (the MMA's M side: 64 a warpgroup on sm_90)
    block_k: int  # capped at the weight block's bk (one scale per K step)
    num_warps: int
    num_stages: int
    fp8_act: bool = True  # e4m3 x e4m3 dot, x quantized per 128 values (bf16 / fp16 x only)
    fma: bool = False  # float32 products on CUDA cores instead of a tensor-core dot (x not quantized)
    waves: int = 4  # programs aimed for per multiprocessor when splitting K
    max_rows: int = 16  # fp8_linear takes the GEMV up to this M (the dots' 16-row tile)


@dataclass(frozen=True)
class PrefillConfig:
    block_m: int  # query rows per program (one head)
    block_n: int  # key rows per tile
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class ChecksumConfig:
    block_bytes: int  # bytes of one block a program sums per layer (block_bytes / word size words)
    layer_group: int  # layers a program sums (unrolled: their loads are in flight together)
    num_warps: int


@dataclass(frozen=True)
class IndexerConfig:
    block_c: int  # candidate keys per program
    num_warps: int
    num_stages: int


# sparse MLA decode: keyed by (capability, kv format, size); "small" for few query heads in the
# batch, "large" where B * S * H >= LARGE_MLA_ROWS (V3.2 records and V4's fp8_v4 pages; V4 bf16 stays "small"); block_h is capped by H.
# sm_90 (docs/kernels.md): larger gathered tiles (64 rows) are faster; 64 heads per program from
# B * H = 2048 up, 16 below and for V4-Flash (no rope tail).
LARGE_MLA_ROWS = 2048
MLA = {
    (90, "bf16", "small"): MLAConfig(block_h=16, block_n=64, num_warps=4, num_stages=2, min_tiles=1),
    (90, "bf16", "large"): MLAConfig(block_h=64, block_n=64, num_warps=8, num_stages=2),
    (90, "fp8", "small"): MLAConfig(block_h=16, block_n=64, num_warps=4, num_stages=2, min_tiles=1),
    (90, "fp8", "large"): MLAConfig(block_h=64, block_n=32, num_warps=8, num_stages=2),
    (120, "bf16", "small"): MLAConfig(block_h=16, block_n=32, num_warps=4, num_stages=2, min_tiles=1),
    (120, "bf16", "large"): MLAConfig(block_h=16, block_n=32, num_warps=4, num_stages=2),
    (120, "fp8", "small"): MLAConfig(block_h=16, block_n=16, num_warps=4, num_stages=3, min_tiles=1),
    (120, "fp8", "large"): MLAConfig(block_h=16, block_n=16, num_warps=4, num_stages=3),
    (CPU, "bf16", "small"): MLAConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, min_tiles=1),
    (CPU, "bf16", "large"): MLAConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, min_tiles=1),
    (CPU, "fp8", "small"): MLAConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, min_tiles=1),
    (CPU, "fp8", "large"): MLAConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, min_tiles=1),
    # DeepSeek-V4 fp8_ds_v4 pages, sm_90 (docs/kernels.md): BN 64 x 4 warps spills, 1 stage is
    # faster than 2, and 64 heads per program pays off at large B*H only (it dequantizes a tile
    # once for 64 heads)
    (90, "fp8_v4", "small"): MLAConfig(block_h=16, block_n=32, num_warps=4, num_stages=1, min_tiles=1),
    (90, "fp8_v4", "large"): MLAConfig(block_h=64, block_n=32, num_warps=8, num_stages=1),
    (120, "fp8_v4", "small"): MLAConfig(block_h=16, block_n=16, num_warps=4, num_stages=3, min_tiles=1),
    (120, "fp8_v4", "large"): MLAConfig(block_h=16, block_n=16, num_warps=4, num_stages=3),
    (CPU, "fp8_v4", "small"): MLAConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, min_tiles=1),
    (CPU, "fp8_v4", "large"): MLAConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, min_tiles=1),
}
# float32 q (parity checks only: IEEE dots, speed does not matter): one small tile that fits
# either GPU's shared memory at D = 512 (+ 64), where the bf16 tiles would not in float32
MLA_FP32 = MLAConfig(block_h=16, block_n=16, num_warps=4, num_stages=1, min_tiles=1)

# fused MoE: keyed by capability, then by rows per expert (T * top_k / E) bucket. Every entry
# fits `moe_smem_bytes` (on sm_90 (32, 64, 128, 4, 4) compiles to 240 KB, over the limit).
MOE = {
    90: {16: MoEConfig(16, 64, 128, 4, 4), 64: MoEConfig(32, 64, 128, 4, 3), 10**9: MoEConfig(64, 64, 64, 4, 4)},
    120: {16: MoEConfig(16, 64, 64, 4, 3), 64: MoEConfig(32, 64, 64, 4, 2), 10**9: MoEConfig(64, 64, 32, 4, 3)},
    CPU: {10**9: MoEConfig(16, 32, 32, 4, 1)},
}
# float32 activations (parity checks only: IEEE dots, speed does not matter): small tiles that
# fit any GPU's shared memory
MOE_FP32 = MoEConfig(16, 32, 32, 4, 2)

# fp8 MoE (block-scaled weights): block_k is the activation group (128), set by the wrapper.
# sm_90 <= 16 rows per expert (docs/kernels.md): BN 128 is faster than 32/64/256.
MOE_FP8 = {
    90: {16: MoEConfig(16, 128, 128, 4, 3), 64: MoEConfig(32, 64, 128, 4, 4), 10**9: MoEConfig(64, 128, 128, 8, 3)},
    120: {16: MoEConfig(16, 64, 128, 4, 3), 64: MoEConfig(32, 64, 128, 4, 2), 10**9: MoEConfig(64, 32, 128, 4, 3)},
    CPU: {10**9: MoEConfig(16, 32, 32, 4, 1)},
}

# block-scaled FP8 GEMM (dense projections): keyed by capability, then by M (rows of x) bucket.
# BN is the MMA's M side (the kernel swaps operands). sm_90 (docs/kernels.md): up to M = 256 the
# e4m3 x e4m3 dots (fp8_act) with K split over the SMs are faster than upcasting the weight; above,
# the Triton dots reach about a third of cuBLAS, so large M dequantizes once and multiplies with
# cuBLAS. sm_120 entries: the same choices sized to 99 KB, compiled, not run.
FP8_GEMM = {
    90: {
        16: Fp8GemmConfig(16, 128, 128, 4, 4, fp8_act=True),
        256: Fp8GemmConfig(64, 128, 128, 4, 3, fp8_act=True),
        10**9: Fp8GemmConfig(128, 128, 128, 8, 3, dequant=True),
    },
    120: {
        16: Fp8GemmConfig(16, 64, 128, 4, 4, fp8_act=True),
        256: Fp8GemmConfig(64, 64, 128, 4, 3, fp8_act=True),
        10**9: Fp8GemmConfig(128, 64, 128, 8, 3, dequant=True),
    },
    CPU: {16: Fp8GemmConfig(16, 32, 32, 4, 1), 10**9: Fp8GemmConfig(32, 32, 32, 4, 1)},
}
# float32 x (parity checks only: IEEE dots, speed does not matter): a tile any GPU fits
FP8_GEMM_FP32 = Fp8GemmConfig(16, 32, 32, 4, 2)

# FP8 GEMV (decode rows, M <= max_rows): keyed by capability. BN 64 is one warpgroup MMA on sm_90
# (mma.sync tiles on sm_120), BK one 128-wide scale block; K is split so that the programs fill
# every SM `waves` times (docs/kernels.md). sm_120: the same tile, 4 stages of 10 KB (compiled, not run).
FP8_GEMV = {
    90: Fp8GemvConfig(64, 128, 4, 4, waves=2),  # waves 2: the H100 sweep's best in most rows (docs/kernels.md)
    120: Fp8GemvConfig(64, 128, 4, 4),
    CPU: Fp8GemvConfig(32, 32, 4, 1, waves=2),
}
FP8_GEMV_FP32 = Fp8GemvConfig(32, 32, 4, 2, fp8_act=False)  # float32 x: IEEE dots (parity runs)

# FP4 MoE (e2m1 weights, ue8m0 scale per 32 values): block_k = K values per loop step (a multiple
# of 32; the register path runs one 32-value group at a time inside it). sm_90 (docs/kernels.md):
# none faster among BN 64-128, BK 64-256, 3-5 stages, 4-8 warps, BM 32-64;
# sm_120 entries are the ones scripts/check_sm120_configs.py compiles without register spills.
MOE_FP4 = {
    90: {16: MoEConfig(16, 64, 128, 4, 3), 64: MoEConfig(32, 64, 128, 4, 3), 10**9: MoEConfig(64, 64, 64, 4, 3)},
    120: {16: MoEConfig(16, 64, 128, 4, 3), 64: MoEConfig(32, 64, 64, 4, 3), 10**9: MoEConfig(64, 32, 64, 4, 3)},
    CPU: {10**9: MoEConfig(16, 32, 64, 4, 1)},
}
MOE_FP4_FP32 = MoEConfig(16, 32, 32, 4, 2)  # float32 x (parity checks only)
# FP4 MoE, fragment layout (`ref_fp4.frag_fp4`): the tile is the layout's 64 x 128; block_m, warps
# (4: a warpgroup owns its 64 rows), stages, split_k and block_n2 (w2's rows a program: 1, 2 or 4
# tiles sharing an activation tile) are free. sm_90: docs/kernels.md; 4 stages from 1 row an expert
_F = MoEConfig(16, 64, 128, 4, 3, 128)
MOE_FP4_FRAG = {
    90: {
        1: _F,
        16: MoEConfig(16, 64, 128, 4, 4, 128),
        64: MoEConfig(32, 64, 128, 4, 3, 128),
        10**9: MoEConfig(64, 64, 128, 4, 3, 128),
    },
    120: {16: _F, 64: MoEConfig(32, 64, 128, 4, 3, 128), 10**9: MoEConfig(32, 64, 128, 4, 2, 64)},
    CPU: {10**9: MoEConfig(16, 64, 128, 4, 1, 128)},
}
MOE_FP4_FRAG_FP32 = MoEConfig(16, 64, 128, 4, 2, 128)
# FP4 weights x MXFP8 activations (`fused_moe_fp4_mx8`: e4m3 x e4m3 `tl.dot_scaled`, sm_120's
# block-scaled MMA); block_n / block_k multiples of 32. sm_120 entries: the largest that
# scripts/check_sm120_configs.py compiles under 99 KB to kind::mxf8f6f4, not timed on that card;
# sm_90 (where Triton upcasts dot_scaled to bf16): the same tiles, for correctness runs, untimed.
# which FP4 MoE path fp4_moe_backend "auto" runs (engine/config.py; docs/kernels.md): W4A16 (the
# fragment-layout kernels) everywhere until the MXFP8 path is measured faster on an sm_120 card
FP4_MOE_BACKEND = {90: "w4a16", 120: "w4a16", CPU: "w4a16"}
MOE_FP4_MX8 = {
    90: {16: MoEConfig(16, 64, 128, 4, 3), 64: MoEConfig(32, 64, 64, 4, 3), 10**9: MoEConfig(64, 64, 128, 4, 3)},
    120: {16: MoEConfig(16, 64, 128, 4, 3), 64: MoEConfig(32, 64, 128, 4, 3), 10**9: MoEConfig(32, 64, 128, 4, 3)},
    CPU: {10**9: MoEConfig(16, 32, 64, 4, 1)},
}

# MLA prefill (non-absorbed, qk 192 = 128 + 64, v 128): keyed by family. Per stage a K tile
# (BN x (128 + 64)) and a V tile (BN x 128) in bf16; q (BM x 192) and p (BM x BN) staged once.
# sm_90 the fastest of benchmarks/engine/bench_prefill.py's variants; sm_120 the largest that
# compiles under 99 KB without spills (scripts/check_sm120_configs.py).
PREFILL = {
    90: PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=3),
    120: PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=2),
    CPU: PrefillConfig(block_m=16, block_n=16, num_warps=4, num_stages=1),
}
PREFILL_FP32 = PrefillConfig(block_m=32, block_n=32, num_warps=4, num_stages=2)  # parity runs only

INDEXER = {
    90: IndexerConfig(block_c=64, num_warps=4, num_stages=3),
    120: IndexerConfig(block_c=64, num_warps=4, num_stages=2),
    CPU: IndexerConfig(block_c=16, num_warps=4, num_stages=1),
}


# KV checksum (kv_checksum.py): no shared memory beyond the reduction's scratch, so both GPU families
# take one tile: 8 layers of 8 KiB, 64 KiB a program in flight; untimed until benchmarks/transfer/
# bench_verify.py runs on a GPU. The interpreter's tile is small, so a block takes several
# programs and the last layer group is masked.
CHECKSUM = {
    90: ChecksumConfig(block_bytes=8192, layer_group=8, num_warps=4),
    120: ChecksumConfig(block_bytes=8192, layer_group=8, num_warps=4),
    CPU: ChecksumConfig(block_bytes=64, layer_group=2, num_warps=4),
}


def _family(cc: int) -> int:
    """sm_100/103 are treated as sm_90 (large shared memory), sm_8x/sm_12x as sm_120."""
    if cc == CPU:
        return CPU
    return 90 if cc in (90, 100, 103) else 120


def mla_config(
    cc: int, kv_format: str, heads: int, rows: int = 1, has_tail: bool = True, fp32: bool = False
) -> MLAConfig:
    """Tiles for `rows` = B * S queries of `heads` heads; `has_tail`: D > d_v (rope dims);
    `fp32`: float32 q on a GPU (the parity tile)."""
    size = "large" if rows * heads >= LARGE_MLA_ROWS and (has_tail or kv_format == "fp8_v4") else "small"
    cfg = MLA_FP32 if fp32 and cc != CPU else MLA[(_family(cc), kv_format, size)]
    block_h = max(16, min(cfg.block_h, 1 << (max(heads, 1) - 1).bit_length()))
    if block_h == cfg.block_h:
        return cfg
    return dataclasses.replace(cfg, block_h=block_h)


def moe_config(cc: int, rows_per_expert: float) -> MoEConfig:
    table = MOE[_family(cc)]
    return table[min(k for k in table if rows_per_expert <= k)]


def moe_fp8_config(cc: int, rows_per_expert: float) -> MoEConfig:
    table = MOE_FP8[_family(cc)]
    return table[min(k for k in table if rows_per_expert <= k)]


def fp8_gemm_config(cc: int, rows: int, dtype: object = None) -> Fp8GemmConfig:
    """Tiles for `rows` (M) rows of x; dtype torch.float32 picks the parity tile on a GPU."""
    if cc != CPU and str(dtype) == "torch.float32":
        return FP8_GEMM_FP32
    table = FP8_GEMM[_family(cc)]
    return table[min(k for k in table if rows <= k)]


def fp8_gemv_config(cc: int, rows: int, dtype: object = None) -> Fp8GemvConfig | None:
    """The GEMV's config for `rows` (M) rows of x, or None where the GEMM takes them (M > max_rows)."""
    cfg = FP8_GEMV[_family(cc)]
    if rows > cfg.max_rows:
        return None
    return FP8_GEMV_FP32 if cc != CPU and str(dtype) == "torch.float32" else cfg


def moe_fp4_config(cc: int, rows_per_expert: float, fp32: bool = False) -> MoEConfig:
    if fp32 and cc != CPU:
        return MOE_FP4_FP32
    table = MOE_FP4[_family(cc)]
    return table[min(k for k in table if rows_per_expert <= k)]


def moe_fp4_frag_config(cc: int, rows_per_expert: float, fp32: bool = False) -> MoEConfig:
    if fp32 and cc != CPU:
        return MOE_FP4_FRAG_FP32
    table = MOE_FP4_FRAG[_family(cc)]
    return table[min(k for k in table if rows_per_expert <= k)]


def fp4_moe_backend(cc: int) -> str:
    """The FP4 experts' path an engine with fp4_moe_backend "auto" takes on this GPU."""
    return FP4_MOE_BACKEND[_family(cc)]


def moe_fp4_mx8_config(cc: int, rows_per_expert: float) -> MoEConfig:
    table = MOE_FP4_MX8[_family(cc)]
    return table[min(k for k in table if rows_per_expert <= k)]


def prefill_config(cc: int, dtype: object = None) -> PrefillConfig:
    """dtype: the query dtype (torch.float32 picks the small parity tile on a GPU)."""
    if cc != CPU and str(dtype) == "torch.float32":
        return PREFILL_FP32
    return PREFILL[_family(cc)]


def checksum_config(cc: int) -> ChecksumConfig:
    return CHECKSUM[_family(cc)]


def indexer_config(cc: int) -> IndexerConfig:
    return INDEXER[_family(cc)]


def mla_smem_bytes(cfg: MLAConfig, block_v: int, block_t: int, kv_format: str) -> int:
    """Shared-memory estimate of one sparse-MLA program (bf16/fp16 q; see module docstring)."""
    if kv_format == "fp8":
        # raw record bytes per stage (e4m3 values, fp32 group scales, bf16 tail) + dequantized tile
        raw = cfg.block_n * (block_v + 4 * (block_v // 128) + 2 * block_t)
        tiles = cfg.num_stages * raw + cfg.block_n * (block_v + block_t) * 2
    elif kv_format == "fp8_v4":
        # raw bytes per stage: at most block_v values of 1-2 bytes (V4: 448 e4m3 + 64 bf16) and 8
        # scale bytes, taken as 1.25 B a value; + the dequantized tile
        raw = cfg.block_n * (block_v * 5 // 4 + 8)
        tiles = cfg.num_stages * raw + cfg.block_n * block_v * 2
    else:
        tiles = cfg.num_stages * cfg.block_n * (block_v + block_t) * 2
    q = cfg.block_h * (block_v + block_t) * 2
    p = cfg.block_h * cfg.block_n * 2
    scratch = cfg.block_h * cfg.block_n * 4
    return tiles + q + p + scratch


def moe_smem_bytes(cfg: MoEConfig) -> int:
    """The larger of the two bf16 kernels: the activation tile plus the weight tiles (gate and up
    for w13, one for w2) times (stages + 2) buffers, and a float32 scratch tile. The + 2 matches
    what Triton 3.6 allocates on sm_90: (16, 64, 128, 4, 4) fits, (32, 64, 128, 4, 4) needs
    6 x 40 KB = 240 KB."""
    w13 = (cfg.num_stages + 2) * (cfg.block_m + 2 * cfg.block_n) * cfg.block_k * 2 + cfg.block_m * cfg.block_n * 4
    w2 = (cfg.num_stages + 2) * (cfg.block_m + cfg.w2_block_n) * cfg.block_k * 2 + cfg.block_m * cfg.w2_block_n * 4
    return max(w13, w2)


def moe_fp8_smem_bytes(cfg: MoEConfig, act_bytes: int = 2) -> int:
    """The larger of the two fp8 kernels: per stage the activation tile in its dtype and the e4m3
    weight tiles (gate + up, or w2) with their scale vectors; plus the quantized activation
    operand and a float32 scratch tile."""
    bm, bk = cfg.block_m, cfg.block_k
    out = []
    for n_tiles, bn in ((2, cfg.block_n), (1, cfg.w2_block_n)):  # w13: gate + up; w2: one tile
        per_stage = bm * bk * act_bytes + n_tiles * bn * (bk + 4)
        out.append(cfg.num_stages * per_stage + bm * bk + bm * bn * 4)
    return max(out)


def indexer_smem_bytes(cfg: IndexerConfig, heads: int, dim: int) -> int:
    return cfg.num_stages * cfg.block_c * dim * 2 + heads * dim * 2 + heads * cfg.block_c * 4
