"""DeepSeek-V4's hyper-connection mixes (Triton `hc_mix`: gates + Sinkhorn-Knopp in registers)
against the float64 reference, and the reference against transformers' own module.

Runs under the Triton interpreter without CUDA; see test_kernels_sparse_mla.py for why
TRITON_INTERPRET is set here, before the first triton import.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from pdserve_kernels.hyper import hc_mix  # noqa: E402
from pdserve_kernels.ref import hc_mix_ref  # noqa: E402
from tests.helpers.kernels import DEVICE, require_interpreter  # noqa: E402

pytestmark = pytest.mark.timeout(300)
require_interpreter()


@pytest.fixture
def poisoned(monkeypatch):
    """Outputs the wrapper allocates start as NaN: a row the kernel does not write fails the test."""
    new_empty = torch.Tensor.new_empty
    monkeypatch.setattr(
        torch.Tensor, "new_empty", lambda self, *size, **kw: new_empty(self, *size, **kw).fill_(float("nan"))
    )


@pytest.mark.parametrize("T,n,iters", [(1, 4, 20), (5, 4, 20), (37, 4, 3), (17, 2, 1), (3, 8, 7)])
def test_hc_mix_matches_reference(T, n, iters, poisoned):
    gen = torch.Generator().manual_seed(T * 100 + n * 10 + iters)
    width = (2 + n) * n
    buf = 3 * torch.randn(T, width + 5, generator=gen)  # row stride > width
    mixes = buf[:, :width]
    base, scale = 0.5 * torch.randn(width, generator=gen), 1 + torch.rand(3, generator=gen)
    got = hc_mix(mixes.to(DEVICE), base.to(DEVICE), scale.to(DEVICE), n, iters, 1e-6)
    want = hc_mix_ref(mixes.double(), base.double(), scale.double(), n, iters, 1e-6)
    for name, g, w in zip(("pre", "post", "comb"), got, want):
        assert g.dtype == torch.float32 and g.shape == w.shape, name
        assert not g.isnan().any(), f"{name}: an element was not written"
        torch.testing.assert_close(g.double().cpu(), w, rtol=2e-5, atol=1e-6, msg=name)
    comb = got[2].double().cpu()
    if iters >= 3:  # Sinkhorn ends on a column normalization: columns sum to ~1
        torch.testing.assert_close(comb.sum(dim=-2), torch.ones(T, n, dtype=torch.float64), rtol=0, atol=1e-4)


def test_hc_mix_refuses_shapes_it_cannot_hold():
    with pytest.raises(ValueError, match="power of two"):
        hc_mix(
            torch.zeros(2, 5 * 3, device=DEVICE),
            torch.zeros(15, device=DEVICE),
            torch.ones(3, device=DEVICE),
            3,
            20,
            1e-6,
        )
    with pytest.raises(ValueError, match=r"want \[T, 24\]"):
        hc_mix(
            torch.zeros(2, 20, device=DEVICE), torch.zeros(24, device=DEVICE), torch.ones(3, device=DEVICE), 4, 20, 1e-6
        )
    pre, post, comb = hc_mix(
        torch.zeros(0, 24, device=DEVICE), torch.zeros(24, device=DEVICE), torch.ones(3, device=DEVICE), 4, 20, 1e-6
    )
    assert pre.shape == (0, 4) and comb.shape == (0, 4, 4)


def test_reference_is_transformers_hyper_connection():
    """The oracle: transformers' DeepseekV4HyperConnection on the same parameters and streams."""
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperConnection

    from pdserve.model.deepseek_v4.hyper_connections import HyperConnection

    cfg = DeepseekV4Config(hidden_size=32, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6)
    theirs = DeepseekV4HyperConnection(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    ours = HyperConnection(32, 4, 20, 1e-6, 1e-6)
    ours.load_state_dict(theirs.state_dict())
    h = torch.randn(6, 4, 32, generator=gen)
    with torch.no_grad():
        for name, g, w in zip(("post", "comb", "collapsed"), ours(h), theirs(h[None])):
            torch.testing.assert_close(g, w[0], rtol=1e-6, atol=1e-6, msg=name)
