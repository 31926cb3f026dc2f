"""The token bitmask of a step's sampling rows: filled on the host by llguidance (its thread pool,
one mask per constrained row) while the device still computes the step, copied to the device
without waiting, applied to the logits there (disallowed tokens -> -inf) before sampling.

The host buffer is pinned (CUDA) and reused: the engine reads each step's sampled tokens before it
fills the next step's masks, and that read waits for the step's copy, so no copy is in flight
when the buffer is written again. Rows without an active grammar are all ones (no change).

Legend: N rows that sample, V vocabulary (the model's, padded), W = ceil(V / 32) mask words a row.
"""

from __future__ import annotations

import os

import llguidance as llg
import torch

from pdserve.structured.matcher import RequestMatcher

MIN_POOL_CORES = 8  # fewer: one row after another on the engine's thread
MIN_POOL_ROWS = 4


class TokenMasks:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.words = -(-vocab_size // 32)
        self.device = device
        self.shifts = torch.arange(32, dtype=torch.int32, device=device)
        # llguidance's pool pays a hand-off per step that a machine with few cores (busy with the
        # engine's own threads) does not earn back: rows are filled one by one there
        cores = os.cpu_count() or 1
        self.executor = llg.LLExecutor(min(16, cores // 2)) if cores >= MIN_POOL_CORES else None
        self.host = self.dev = None  # [capacity, W] int32, grown as batches grow
        self.rows = 0

    def _buffers(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.host is None or self.rows < n:
            self.rows = max(n, 2 * self.rows, 16)
            pin = self.device.type == "cuda"
            self.host = torch.empty((self.rows, self.words), dtype=torch.int32, pin_memory=pin)
            self.dev = self.host if not pin else torch.empty_like(self.host, device=self.device)
        return self.host[:n], self.dev[:n]

    def fill(self, matchers: list[RequestMatcher | None]) -> torch.Tensor | None:
        """The rows' masks [N, W] on the device (copy queued), None when no row is constrained."""
        rows = [(m.matcher, i) for i, m in enumerate(matchers) if m is not None and m.active]
        if not rows:
            return None
        n = len(matchers)
        host, dev = self._buffers(n)
        if len(rows) < n:
            host.fill_(-1)
        if self.executor is not None and len(rows) >= MIN_POOL_ROWS:
            self.executor.unsafe_compute_mask_ptr(rows, host.data_ptr(), self.words * 4, n)
        else:
            for matcher, i in rows:
                matcher.unsafe_compute_mask_ptr(host[i].data_ptr(), self.words * 4)
        if self.dev is not self.host:
            dev.copy_(host, non_blocking=True)
        return dev

    def apply(self, x: torch.Tensor, mask: torch.Tensor) -> None:
        """x [N, V] (float): tokens whose bit is 0 become -inf, in place."""
        n, V = x.shape
        bits = (mask[:, :, None] >> self.shifts) & 1  # [N, W, 32]
        x.masked_fill_(bits.view(n, -1)[:, :V] == 0, float("-inf"))
