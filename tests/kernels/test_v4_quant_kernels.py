"""DeepSeek-V4's kept FP4 experts and FP8 projections through the Triton kernels (interpreted on
CPU, TRITON_INTERPRET set before triton's first import as in the kernel tests) against the torch
references the CPU tests run: the modules as the loader fills them from a V4-Flash-format
checkpoint (packed bytes, ue8m0 scale bytes, e4m3 + float32 block scales, o_a_proj's groups in one
launch), fresh random inputs of an odd token count."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from pdserve.model import ops  # noqa: E402
from pdserve.model.deepseek_v4.loader import load_v4_model  # noqa: E402
from pdserve.tiny_model import make_tiny_model, quantize_tiny_v4  # noqa: E402
from tests.helpers.kernels import DEVICE, REL_TOL, rel_err, require_interpreter  # noqa: E402

pytestmark = pytest.mark.timeout(300)
require_interpreter()


@pytest.fixture(scope="module")
def layer(tmp_path_factory):
    root = tmp_path_factory.mktemp("v4_quant_kernels")
    quant, _ = quantize_tiny_v4(
        make_tiny_model(root / "float", arch="deepseek_v4"), root / "q", root / "r", block=(32, 32)
    )
    return load_v4_model(quant, torch.float32, DEVICE).model.layers[2]  # CSA: the indexer's q_b_proj too


def _both(fn):
    """fn() on the torch references, then on the Triton kernels."""
    try:
        ops.set_backend("torch")
        want = fn()
        ops.set_backend("triton")
        return want, fn()
    finally:
        ops.set_backend(None)


def test_fp4_experts(layer):
    g = torch.Generator().manual_seed(3)
    T, E, k = 7, layer.mlp.experts.gate_up_proj.shape[0], 2
    x = torch.randn(T, layer.mlp.experts.gate_up_proj.shape[2] * 2, generator=g).to(DEVICE)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).to(DEVICE)  # int64, as the router's
    weights = torch.rand(T, k, generator=g).to(DEVICE)
    want, got = _both(lambda: layer.mlp.experts(x, weights, ids))
    assert rel_err(got, want) < REL_TOL[torch.float32]


@pytest.mark.parametrize("name", ["q_b_proj", "o_a_proj", "o_b_proj", "compressor.indexer.q_b_proj"])
def test_fp8_projections(layer, name):
    proj = layer.self_attn.get_submodule(name)
    assert proj.weight.dtype == torch.float8_e4m3fn
    g = torch.Generator().manual_seed(4)
    K = proj.weight.shape[1]
    shape = (5, proj.groups, K) if name == "o_a_proj" else (5, K)  # grouped: [T, G, in/G]
    x = torch.randn(*shape, generator=g).to(DEVICE)
    want, got = _both(lambda: proj(x))
    assert rel_err(got, want) < REL_TOL[torch.float32]
