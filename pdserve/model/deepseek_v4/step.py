"""One DeepSeek-V4 forward's metadata (V4Step) over the paged pool: built on the device once per
step from the ForwardBatch (block tables, window tables, state slots, starts and lengths) and read
by every layer. Nothing goes to the host: the shapes come from host ints the batch already
carries (T, B, `max_context`; T == B: every chunk is one token), so a step of either kind can be
captured in a CUDA graph (engine/cuda_graphs.py: decode steps, and speculative decoding's verify
steps of equal chunks).

Legend: T tokens of the step (all sequences, flat), B sequences, n_b its tokens before the step,
L_b its new ones, p a token's position, W sliding_window, bs tokens per block, m a compressor's
rate, e an entry (positions e*m .. e*m+m-1), Em = max_context // m, U compressor groups the step
touches (a bound), R rope dims.

Attention reads the pool where it lies (`ops.sparse_mla_decode` with a second key source):
  - `window` [T, W]: the keys of positions (p - W, p] (-1 below 0). Each layer first writes the
    step's new kv to the window region (`window_write`). In a decode step (every chunk one token)
    every position a query reads has a window block, so `window` holds window-region rows. A step
    with longer chunks keeps window blocks only for each sequence's last W-1 positions (the block
    manager's window space): there each layer reads a key buffer [B*(W-1) + T, D] of the W-1
    records before each sequence's chunk (`window_old`, one gather) and the step's new kv, and
    `window` holds rows of that buffer; new tokens without a window block write nothing (their
    write repeats their sequence's last token's, same row and value);
  - entries (CSA / HCA layers, rate m): rows of the entries region. Entry e of sequence b lives in
    record e % page of block table[b, e // page] (`EntryIndex`: page = bs // m when m divides bs;
    else one entry a block, every (m / bs)-th block of the block table); a query may see entries
    e < seen = (p + 1) // m (all of the entry's tokens are <= p). HCA layers read all of them
    (`visible` [T, Em]); CSA layers the indexer's top-k of them (`ops.indexer_topk_paged` over the
    same table, which returns rows of the region).
The compressors advance by `GroupPlan` (one per rate): every group of m positions the step
touches, the rows its tokens come from (the state's pending rows or the step's new ones), where
its entry goes, and which group ends each sequence (the new pending rows and overlap).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.model.batch import ForwardBatch
from pdserve.model.rope import RotaryEmbedding


@dataclass
class GroupPlan:
    """The U groups (m positions each) the step touches, sequence by sequence; U is a bound known
    on the host, and the rows past the real groups repeat the last real one (they compute and
    write the same values, so the writes stay deterministic)."""

    seq: torch.Tensor  # [U] int64, the group's sequence
    src: torch.Tensor  # [U, m] int64, rows of [B*(m-1) pending rows of the states ; T new rows]
    present: torch.Tensor  # [U, m] bool, the position is cached or new (else: not yet seen)
    first: torch.Tensor  # [U] bool, the sequence's first group of the step (its previous group's Ca is in the state)
    prev: torch.Tensor  # [U] int64, the row of the group before it (when not first)
    has_prev: torch.Tensor  # [U] bool, e >= 1 (else the previous Ca is the initial kv 0, gate -inf)
    slot: torch.Tensor  # [U] int64, entries-region row of entry e (an incomplete group's partial entry is never read)
    last: torch.Tensor  # [B] int64, each sequence's last group of the step
    pending: torch.Tensor  # [B] int64, (n + L) % m: rows of that group left pending
    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin [U, R/2] of the compress rope at e*m
    start: torch.Tensor | None = None  # [B] int64 the new tokens' positions, in a decode plan only (U = B)


@dataclass
class EntryIndex:
    """Where a rate's entries lie, and which a query may see."""

    rate: int
    table: torch.Tensor  # [B, Wt] int32: entry e of sequence b is in block table[b, e // page]
    page: int  # entries a block of `table` holds
    seen: torch.Tensor  # [T] int32, (p + 1) // m
    max_seen: int  # Em = max_context // m >= every seen
    groups: GroupPlan
    visible: torch.Tensor | None = None  # [T, Em] int32 rows of the entries a query sees (HCA rates)

    @classmethod
    def from_kernel(cls, got: dict[str, torch.Tensor], rate: int, max_seen: int, **plan: torch.Tensor) -> EntryIndex:
        """The index a fused step kernel returned as a dict (kernels/v4_step.py, v4_chunk_step.py);
        `plan` gives the GroupPlan fields a decode step knows without the kernel (seq, last, start)."""
        fields = ("seq", "src", "present", "first", "prev", "has_prev", "slot", "last", "pending")
        groups = GroupPlan(**({k: got[k] for k in fields if k in got} | plan), rope=(got["cos"], got["sin"]))
        return cls(rate, got["table"], got["page"], got["seen"], max_seen, groups, got["visible"])


@dataclass
class V4Step:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    seq_ids: torch.Tensor  # [T] int32, each token's sequence
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # "main" / "compress" -> cos, sin [T, R/2]
    window: torch.Tensor  # [T, W] int32 key rows of (p - W, p], -1 below 0
    window_write: torch.Tensor  # [T] int64 window-region rows the new kv goes to
    window_src: torch.Tensor | None  # [T] int64 rows of the new kv written there (None: all, in order)
    window_old: torch.Tensor | None  # [B*(W-1)] int64 window-region rows of the key buffer (None: read the region)
    state_slots: torch.Tensor  # [B] int64
    entries: dict[int, EntryIndex] = field(default_factory=dict)  # rate -> where its entries lie
    state_dst: torch.Tensor | None = None  # [B] int64 slots the new state records go to (None: state_slots)


def build_step(
    batch: ForwardBatch, rotary: dict[str, RotaryEmbedding], window: int, csa_rates: set[int], hca_rates: set[int]
) -> V4Step:
    """The metadata of one forward over the batch's B sequences (on the batch's device)."""
    pos, seq = batch.positions, batch.seq_ids.long()
    decode = batch.num_tokens == batch.starts.shape[0]  # every chunk one token: one group a sequence, no window gaps
    step = V4Step(
        input_ids=batch.input_ids,
        positions=pos,
        seq_ids=batch.seq_ids,
        rope={kind: r(pos) for kind, r in rotary.items()},
        state_slots=batch.state_slots,
        state_dst=batch.state_dst,
        **(window_in_pool(batch, window) if decode else window_buffer(batch, window)),
    )
    for m in sorted(csa_rates | hca_rates):
        ix = entry_index(batch, m, decode, rotary["compress"])
        if m in hca_rates:
            ix.visible = visible_rows(ix, seq)
        step.entries[m] = ix
    return step


def _check(ok: torch.Tensor, msg: str) -> None:
    """A device-side check, no host sync (skipped while a CUDA graph is captured)."""
    if not (ok.is_cuda and torch.cuda.is_current_stream_capturing()):
        torch._assert_async(ok, msg)


def _rows(window_tables: torch.Tensor, seq: torch.Tensor, q: torch.Tensor, bs: int) -> torch.Tensor:
    """Window-region rows (int64) of positions q >= 0 of sequences seq (same shapes)."""
    return window_tables[seq, q // bs] * bs + q % bs


def window_in_pool(batch: ForwardBatch, window: int) -> dict:
    """A decode step's window fields: rows of the window region itself."""
    pos, seq, wt, bs = batch.positions, batch.seq_ids.long(), batch.window_tables, batch.block_size
    q = pos[:, None] - window + 1 + torch.arange(window, device=pos.device)  # [T, W]
    ok = q >= 0
    blocks = wt[seq[:, None], q.clamp(min=0) // bs]
    # a position in the window without a block is a block-manager bug: it would read another row
    _check(~(ok & (blocks < 0)).any(), "a window position has no window block")
    rows = torch.where(ok, blocks * bs + q.clamp(min=0) % bs, -1).to(torch.int32)
    return dict(window=rows, window_write=_rows(wt, seq, pos, bs), window_src=None, window_old=None)


def window_buffer(batch: ForwardBatch, window: int) -> dict:
    """A prefill step's window fields: rows of the key buffer [B*K old records ; T new], K = W-1
    (sequence b's record of position n_b - K + j at row b*K + j)."""
    n, L, pos, seq = batch.starts, batch.lens, batch.positions, batch.seq_ids.long()
    wt, bs, K, B = batch.window_tables, batch.block_size, window - 1, batch.starts.shape[0]
    dev = n.device
    q_old = n[:, None] - K + torch.arange(K, device=dev)  # [B, K]
    b_old = torch.arange(B, device=dev)[:, None].expand(-1, K)
    old = _rows(wt, b_old, q_old.clamp(min=0), bs)
    _check(~((q_old >= 0) & (old < 0)).any(), "a window position has no window block")
    q = pos[:, None] - window + 1 + torch.arange(window, device=dev)  # [T, W]
    ns, first_row = n[seq][:, None], (torch.cumsum(L, 0) - L)[seq][:, None]
    rows = torch.where(q < ns, seq[:, None] * K + q - ns + K, B * K + first_row + q - ns)
    # only each sequence's last K positions have window blocks: the others repeat its last token's write
    has_block = wt[seq, pos // bs] >= 0
    src = torch.where(has_block, torch.arange(pos.shape[0], device=dev), (torch.cumsum(L, 0) - 1)[seq])
    return dict(
        window=torch.where(q >= 0, rows, -1).to(torch.int32),
        window_write=_rows(wt, seq, pos[src], bs),
        window_src=src,
        window_old=torch.where(q_old >= 0, old, 0).flatten(),
    )


def entry_table(block_tables: torch.Tensor, rate: int, bs: int) -> tuple[torch.Tensor, int]:
    """(table [B, Wt] int32, page): entry e lies in record e % page of block table[b, e // page]."""
    if rate <= bs:  # m divides bs: bs // m entries a block
        return block_tables, bs // rate
    return block_tables[:, :: rate // bs].contiguous(), 1  # one entry a block, in every (m / bs)-th block


def entry_rows(table: torch.Tensor, page: int, seq: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """Entries-region rows (int64) of entries e of sequences seq (same shapes)."""
    return table[seq, e // page].long() * page + e % page


def visible_rows(ix: EntryIndex, seq: torch.Tensor) -> torch.Tensor:
    """[T, Em] int32 rows of the entries each query sees, -1 past them."""
    e = torch.arange(ix.max_seen, device=seq.device)  # [Em]
    seen = e[None, :] < ix.seen[:, None]  # [T, Em]
    rows = entry_rows(
        ix.table,
        ix.page,
        seq[:, None].expand(-1, ix.max_seen),
        e.expand(seq.shape[0], -1).clamp(max=max(ix.max_seen - 1, 0)),
    )
    return torch.where(seen, rows, -1).to(torch.int32)


def entry_index(batch: ForwardBatch, m: int, decode: bool, rotary: RotaryEmbedding) -> EntryIndex:
    table, page = entry_table(batch.block_tables, m, batch.block_size)
    return EntryIndex(
        rate=m,
        table=table,
        page=page,
        seen=((batch.positions + 1) // m).to(torch.int32),
        max_seen=batch.max_context // m,
        groups=group_plan(batch, m, table, page, decode, rotary),
    )


def group_plan(
    batch: ForwardBatch, m: int, table: torch.Tensor, page: int, decode: bool, rotary: RotaryEmbedding
) -> GroupPlan:
    """The groups of rate m the step touches. Sequence b touches groups n // m ..
    (n + L - 1) // m: at most (L + m - 2) // m + 1, so U = (T + B*(m-2)) // m + B bounds them all
    (U = B when every chunk is one token)."""
    if decode:
        return decode_group_plan(batch, m, table, page, rotary)
    n, L = batch.starts, batch.lens
    B, T, dev = n.shape[0], batch.num_tokens, n.device
    U = (T + B * max(m - 2, 0)) // m + B
    first_g = n // m  # [B]
    count = (n + L - 1) // m - first_g + 1  # [B] groups touched
    ends = torch.cumsum(count, 0)  # [B]
    u = torch.minimum(torch.arange(U, device=dev), ends[-1] - 1)  # padding repeats the last group
    s = torch.searchsorted(ends, u, right=True)  # [U]
    g = u - (ends[s] - count[s])  # the group's rank within its sequence
    e = first_g[s] + g  # [U] entry index
    q = e[:, None] * m + torch.arange(m, device=dev)  # [U, m] positions
    ns, first_row = n[s][:, None], (torch.cumsum(L, 0) - L)[s][:, None]
    pending_row = s[:, None] * (m - 1) + q - first_g[s][:, None] * m  # a state row (q < n)
    new_row = B * (m - 1) + first_row + q - ns  # a row of the step (n <= q < n + L)
    present = q < ns + L[s][:, None]
    src = torch.where(q < ns, pending_row, new_row).clamp(0, B * (m - 1) + T - 1)
    src = torch.where(present, src, 0)
    cos, sin = rotary(e * m)
    return GroupPlan(
        seq=s, src=src, present=present, first=g == 0, prev=(u - 1).clamp(min=0), has_prev=e >= 1,
        slot=entry_rows(table, page, s, e), last=ends - 1, pending=(n + L) % m, rope=(cos, sin),
    )  # fmt: skip


def decode_group_plan(
    batch: ForwardBatch, m: int, table: torch.Tensor, page: int, rotary: RotaryEmbedding
) -> GroupPlan:
    """`group_plan` of a decode step (every chunk one token, U = B): sequence b touches one group,
    e = n // m, whose positions before n are its state's pending rows b*(m-1) + j and whose
    position n is the step's row b. The same plan in a third of group_plan's launches."""
    n, B = batch.starts, batch.starts.shape[0]
    s = batch.decode_rows  # [B] = arange(B): every token is a one-token chunk
    e, r = n // m, (n % m)[:, None]  # [B], [B, 1]: the new token's place in its group
    j = torch.arange(m, device=n.device)  # [m]
    src = torch.where(j < r, s[:, None] * (m - 1) + j, (B * (m - 1) + s)[:, None])  # [B, m]
    present = j <= r
    cos, sin = rotary(e * m)
    return GroupPlan(
        seq=s, src=src.masked_fill(~present, 0), present=present, first=torch.ones_like(present[:, 0]),
        prev=(s - 1).clamp(min=0), has_prev=e >= 1, slot=entry_rows(table, page, s, e), last=s,
        pending=(n + 1) % m, rope=(cos, sin), start=n,
    )  # fmt: skip
