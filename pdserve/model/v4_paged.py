"""DeepSeek-V4 on the paged KV pool: its cache kinds as regions of one KVCache, and the model run
with the DeepseekForCausalLM interface (`forward(batch, kv_cache)`, `compute_logits`,
`kv_cache_specs()`, `num_layers`) that the engine drives.

Legend: D head_dim, Di index_head_dim, W sliding_window, mc / mh the CSA / HCA rates, n tokens of
a sequence in the cache, bs tokens per block, E = n // m entries, P = n % m pending tokens.

Regions (kv_cache.py's KVRegionSpec), each paged by one block space (engine/block_manager.py):

| region          | layers | space  | record covers          | values per record                    |
| --------------- | ------ | ------ | ---------------------- | ------------------------------------ |
| window          | all    | window | 1 token (last W-1 kept) | D: the K=V record (normed, roped)   |
| csa_kv          | CSA    | tokens | mc tokens (one entry)  | D: compressed entry                  |
| csa_index_k     | CSA    | tokens | mc tokens (one entry)  | Di: the indexer's compressed key     |
| hca_kv          | HCA    | tokens | mh tokens (one entry)  | D: compressed entry                  |
| csa_state       | CSA    | state  | the sequence           | pending kv, gate [mc-1, 2D] x2, overlap kv, gate [mc, D] x2 |
| csa_index_state | CSA    | state  | the sequence           | the same at Di                       |
| hca_state       | HCA    | state  | the sequence           | pending kv, gate [mh-1, D] x2        |

So a sequence's pool footprint is its compressed entries and indexer keys (token blocks, growing
~6.9 KB/token for V4-Flash in bf16), the blocks of its last W-1 positions (window blocks, freed
behind the window as it runs) and one state slot; all three are the BlockManager's to account,
and a prefill -> decode transfer moves the entries, the window's last W-1 positions and the state.
Each step gathers every scheduled sequence's SequenceState from the pool (the last W-1 window
records, all E entries, the P pending rows and the overlap), runs DeepseekV4ForCausalLM on the
flat batch, and writes back what the step added (new window records, new entries, the state).
The window region is paged by the pool's window space (the sequence's window_table,
engine/block_manager.py): it holds blocks only for the last W-1 positions and the step's new
ones, and the block manager frees the blocks that fall out of the window as the sequence runs.
"""

from __future__ import annotations

import torch
from torch import nn

from pdserve.model.batch import ForwardBatch
from pdserve.model.config import ModelConfig
from pdserve.model.config_v4 import CSA, HCA
from pdserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from pdserve.model.kv_cache import PER_SEQUENCE, KVCache, KVRegionSpec
from pdserve.model.v4_cache import CompressorState, LayerState, SequenceState

# entries region -> (its running-state region, overlapping series?)
_COMPRESSED = {
    "csa_kv": ("csa_state", True),
    "csa_index_k": ("csa_index_state", True),
    "hca_kv": ("hca_state", False),
}


def v4_kv_specs(config: ModelConfig) -> list[KVRegionSpec]:
    v4, D, Di = config.v4, config.v4.head_dim, config.index_head_dim
    csa = tuple(i for i, t in enumerate(v4.layer_types) if t == CSA)
    hca = tuple(i for i, t in enumerate(v4.layer_types) if t == HCA)
    specs = [KVRegionSpec("window", D, last_tokens=v4.sliding_window - 1)]
    if csa:
        mc = v4.csa_rate
        specs += [
            KVRegionSpec("csa_kv", D, csa, mc),
            KVRegionSpec("csa_index_k", Di, csa, mc),
            KVRegionSpec("csa_state", _state_dim(D, mc, True), csa, PER_SEQUENCE),
            KVRegionSpec("csa_index_state", _state_dim(Di, mc, True), csa, PER_SEQUENCE),
        ]
    if hca:
        mh = v4.hca_rate
        specs += [KVRegionSpec("hca_kv", D, hca, mh), KVRegionSpec("hca_state", _state_dim(D, mh, False), hca, PER_SEQUENCE)]
    return [s for s in specs if s.dim > 0]


def _state_dim(dim: int, rate: int, overlap: bool) -> int:
    width = 2 * dim if overlap else dim
    return 2 * (rate - 1) * width + (2 * rate * dim if overlap else 0)


def _pack(st: CompressorState, dim: int, rate: int, overlap: bool) -> torch.Tensor:
    """The running state as one record [state_dim]: pending kv, pending gate (zero padded to
    rate-1 rows), then (overlap) overlap kv, overlap gate."""
    width = 2 * dim if overlap else dim
    pad = st.pending_kv.new_zeros(rate - 1 - st.pending_kv.shape[0], width)
    parts = [torch.cat([st.pending_kv, pad]), torch.cat([st.pending_gate, pad])]
    if overlap:
        parts += [st.overlap_kv, st.overlap_gate]
    return torch.cat([p.reshape(-1) for p in parts])


def _unpack(rec: torch.Tensor, entries: torch.Tensor, pending: int, dim: int, rate: int, overlap: bool) -> CompressorState:
    width = 2 * dim if overlap else dim
    n = (rate - 1) * width
    kv, gate = rec[:n].view(rate - 1, width), rec[n : 2 * n].view(rate - 1, width)
    st = CompressorState(entries=entries, pending_kv=kv[:pending].clone(), pending_gate=gate[:pending].clone())
    if overlap:
        if entries.shape[0] == 0:  # no complete group yet: the initial overlap (gate -inf)
            fresh = CompressorState.empty(dim, rate, True, rec.dtype, rec.device)
            st.overlap_kv, st.overlap_gate = fresh.overlap_kv, fresh.overlap_gate
        else:
            tail = rec[2 * n :].view(2, rate, dim)
            st.overlap_kv, st.overlap_gate = tail[0].clone(), tail[1].clone()
    return st


class PagedDeepseekV4(nn.Module):
    """DeepseekV4ForCausalLM (`self.model`) over the paged pool."""

    def __init__(self, model: DeepseekV4ForCausalLM) -> None:
        super().__init__()
        self.model = model
        self.config = model.config
        self.num_layers = model.num_layers

    def kv_cache_specs(self, kv_cache_dtype: str = "auto") -> list[KVRegionSpec]:
        if kv_cache_dtype != "auto":
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not built for DeepSeek-V4 yet (its records are the model dtype)")
        return v4_kv_specs(self.config)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch, kv_cache: KVCache) -> torch.Tensor:
        """Runs every token of the batch; writes what each sequence's cache gains; returns
        final-normed hidden [T, hidden]."""
        starts, lens = batch.starts.tolist(), batch.lens.tolist()
        slots = batch.state_slots.tolist()
        if kv_cache.num_state_slots and min(slots, default=0) < 0:  # -1 would index the last slot
            raise RuntimeError(f"a sequence in the step has no state slot: {slots}")
        tables = [(batch.block_tables[b], batch.window_tables[b], slots[b]) for b in range(len(lens))]
        states = [self.load_state(kv_cache, *t, n) for t, n in zip(tables, starts)]
        hidden = self.model(batch.input_ids, lens, states)
        for table, start, st in zip(tables, starts, states):
            self.store_state(kv_cache, *table, start, st)
        return hidden

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)

    # -- the pool <-> SequenceState --
    def load_state(self, kv: KVCache, table: torch.Tensor, window_table: torch.Tensor, slot: int, n: int) -> SequenceState:
        """The cache state of a sequence with n tokens in the blocks of `table` [n_blocks], the
        window-space blocks of `window_table` [n_blocks] (-1 where freed) and state slot `slot`."""
        v4, layers = self.config.v4, []
        keep = min(n, v4.sliding_window - 1)
        window_slots = _window_slots(kv, window_table, n - keep, n)
        for i, kind in enumerate(v4.layer_types):
            st = LayerState(window=kv.layer("window", i)[window_slots])
            if kind == CSA:
                st.compressor = self._load_compressor(kv, "csa_kv", i, table, slot, n)
                st.indexer = self._load_compressor(kv, "csa_index_k", i, table, slot, n)
            elif kind == HCA:
                st.compressor = self._load_compressor(kv, "hca_kv", i, table, slot, n)
            layers.append(st)
        return SequenceState(num_tokens=n, layers=layers)

    def _load_compressor(self, kv: KVCache, name: str, layer: int, table: torch.Tensor, slot: int, n: int) -> CompressorState:
        spec, (state_name, overlap) = kv.specs[name], _COMPRESSED[name]
        m, flat = spec.tokens_per_record, kv.layer(name, layer)
        entries = flat[kv.slots(name, table, 0, n // m).to(flat.device)]
        rec = kv.layer(state_name, layer)[slot] if state_name in kv.specs else flat.new_zeros(0)
        return _unpack(rec, entries, n % m, spec.dim, m, overlap)

    def store_state(
        self, kv: KVCache, table: torch.Tensor, window_table: torch.Tensor, slot: int, n0: int, st: SequenceState
    ) -> None:
        """Write what the step from n0 to st.num_tokens tokens added: new window records, new
        entries, and the running state."""
        n1 = st.num_tokens
        first = max(n0, n1 - st.layers[0].window.shape[0]) if st.layers else n1
        window_slots = _window_slots(kv, window_table, first, n1)
        for i, layer in enumerate(st.layers):
            kv.layer("window", i)[window_slots] = layer.window[layer.window.shape[0] - (n1 - first) :]
            if layer.compressor is not None:
                name = "csa_kv" if layer.indexer is not None else "hca_kv"
                self._store_compressor(kv, name, i, table, slot, n0, n1, layer.compressor)
            if layer.indexer is not None:
                self._store_compressor(kv, "csa_index_k", i, table, slot, n0, n1, layer.indexer)

    def _store_compressor(self, kv: KVCache, name: str, layer: int, table, slot: int, n0: int, n1: int, st: CompressorState) -> None:
        spec, (state_name, overlap) = kv.specs[name], _COMPRESSED[name]
        m, flat = spec.tokens_per_record, kv.layer(name, layer)
        e0, e1 = n0 // m, n1 // m
        if e1 > e0:
            flat[kv.slots(name, table, e0, e1).to(flat.device)] = st.entries[e0:e1]
        if state_name in kv.specs:
            kv.layer(state_name, layer)[slot] = _pack(st, spec.dim, m, overlap)


def _window_slots(kv: KVCache, window_table: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Window-region record ids of positions start..end-1; every one must have a block (a
    missing one is a block-manager bug, and a -1 would silently index the pool's last block)."""
    table = window_table.cpu()
    if end > start and (table[start // kv.block_size : -(-end // kv.block_size)] < 0).any():
        raise RuntimeError(f"window positions {start}..{end - 1} have no window block (table {table.tolist()})")
    return kv.slots("window", table, start, end).to(kv.layer("window", 0).device)


def region_bytes(config: ModelConfig, block_size: int, itemsize: int) -> dict[str, dict[str, int]]:
    """Per region of the V4 pool: "block" (bytes of one block over the region's layers) and
    "record" (bytes of one record of one layer) at `itemsize` bytes per value."""
    out = {}
    for s in v4_kv_specs(config):
        layers = len(s.layer_ids(config.num_hidden_layers))
        out[s.name] = {"record": s.dim * itemsize, "block": layers * s.records_per_block(block_size) * s.dim * itemsize}
    return out
