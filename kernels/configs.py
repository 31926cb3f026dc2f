"""Tile configurations for the decode kernels, sm_90 (H100/H200) and sm_120 (RTX PRO 6000)
side by side, with the shared-memory estimate each sm_120 entry is checked against (tests).

An sm_120 block gets at most 99 KB of shared memory (101376 bytes opt-in), an sm_90 block
227 KB. The estimate counts what Triton keeps in shared memory for these kernels: one buffer per
pipeline stage for every tile loaded in the loop, the dot operands it stages (q, the probability
tile), and a layout-conversion scratch tile; it is deliberately on the high side.
The sm_90 entries were picked by the sweep in `bench.py` on an H200 (see docs/kernels.md);
the sm_120 entries are the largest tiles whose estimate fits, not measured on that card.

Legend: H heads, BH heads per program, BN KV rows (or candidates) per tile, BV/BT padded value and
tail (rope) dims, BM/BN/BK GEMM tile, E experts.
"""

from __future__ import annotations

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


@dataclass(frozen=True)
class MoEConfig:
    block_m: int  # sorted (token, expert) rows per tile
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class IndexerConfig:
    block_c: int  # candidate keys per program
    num_warps: int
    num_stages: int


# sparse MLA decode: keyed by (capability, kv format, size); "small" for few query heads in the
# batch, "large" where B * S * H >= LARGE_MLA_ROWS (V3.2 records); block_h is capped by H.
# sm_90 picks from the H200 sweep (docs/kernels.md): larger gathered tiles (64 rows) always won;
# 64 heads per program won from B * H = 2048 up, 16 below and for V4-Flash (no rope tail).
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
}

# fused MoE: keyed by capability, then by rows per expert (T * top_k / E) bucket.
MOE = {
    90: {16: MoEConfig(16, 64, 128, 4, 4), 64: MoEConfig(32, 64, 128, 4, 4),
         10**9: MoEConfig(64, 128, 64, 8, 4)},
    120: {16: MoEConfig(16, 64, 64, 4, 4), 64: MoEConfig(32, 64, 64, 4, 3),
          10**9: MoEConfig(64, 64, 64, 4, 3)},
    CPU: {10**9: MoEConfig(16, 32, 32, 4, 1)},
}

INDEXER = {
    90: IndexerConfig(block_c=64, num_warps=4, num_stages=3),
    120: IndexerConfig(block_c=64, num_warps=4, num_stages=2),
    CPU: IndexerConfig(block_c=16, num_warps=4, num_stages=1),
}


def _family(cc: int) -> int:
    """sm_100/103 are treated as sm_90 (large shared memory), sm_8x/sm_12x as sm_120."""
    if cc == CPU:
        return CPU
    return 90 if cc in (90, 100, 103) else 120


def mla_config(cc: int, kv_format: str, heads: int, rows: int = 1, has_tail: bool = True) -> MLAConfig:
    """Tiles for `rows` = B * S queries of `heads` heads; `has_tail`: D > d_v (rope dims)."""
    size = "large" if rows * heads >= LARGE_MLA_ROWS and has_tail else "small"
    cfg = MLA[(_family(cc), kv_format, size)]
    block_h = max(16, min(cfg.block_h, 1 << (max(heads, 1) - 1).bit_length()))
    if block_h == cfg.block_h:
        return cfg
    return MLAConfig(block_h, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.waves, cfg.min_tiles)


def moe_config(cc: int, rows_per_expert: float) -> MoEConfig:
    table = MOE[_family(cc)]
    return table[min(k for k in table if rows_per_expert <= k)]


def indexer_config(cc: int) -> IndexerConfig:
    return INDEXER[_family(cc)]


def mla_smem_bytes(cfg: MLAConfig, block_v: int, block_t: int, kv_format: str) -> int:
    """Shared-memory estimate of one sparse-MLA program (bf16/fp16 q; see module docstring)."""
    if kv_format == "fp8":
        # raw record bytes per stage (e4m3 values, fp32 group scales, bf16 tail) + dequantized tile
        raw = cfg.block_n * (block_v + 4 * (block_v // 128) + 2 * block_t)
        tiles = cfg.num_stages * raw + cfg.block_n * (block_v + block_t) * 2
    else:
        tiles = cfg.num_stages * cfg.block_n * (block_v + block_t) * 2
    q = cfg.block_h * (block_v + block_t) * 2
    p = cfg.block_h * cfg.block_n * 2
    scratch = cfg.block_h * cfg.block_n * 4
    return tiles + q + p + scratch


def moe_smem_bytes(cfg: MoEConfig) -> int:
    """The w13 kernel is the larger one: x tile plus gate and up weight tiles per stage."""
    per_stage = (cfg.block_m * cfg.block_k + 2 * cfg.block_n * cfg.block_k) * 2
    return cfg.num_stages * per_stage + cfg.block_m * cfg.block_n * 4


def indexer_smem_bytes(cfg: IndexerConfig, heads: int, dim: int) -> int:
    return cfg.num_stages * cfg.block_c * dim * 2 + heads * dim * 2 + heads * cfg.block_c * 4
