"""What oracles share: transformers' models run with a fixed rule for top-k ties.

ReLU'd index scores (DeepSeek-V3.2's and V4's indexers) tie exactly at 0 whenever fewer than k
entries score above 0, and torch.topk's pick among equal values depends on the row's length:
transformers' logits at a position then change with the number of tokens after it. pdserve takes
ties in position order (kernels/ref.py `topk_first`); an oracle with few index heads runs under
`first_topk`, which keeps transformers' values and fixes the order the same way.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch


@contextmanager
def first_topk():
    """torch.topk (function and method) with ties at the k-th value taken in position order: a
    stable sort, the same values. For oracles only (module docstring: why)."""

    def topk(x, k, dim=-1, largest=True, sorted=True):  # noqa: A002 - torch's own argument name
        values, indices = torch.sort(x, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))

    saved = torch.topk, torch.Tensor.topk
    torch.topk = torch.Tensor.topk = topk
    try:
        yield
    finally:
        torch.topk, torch.Tensor.topk = saved
