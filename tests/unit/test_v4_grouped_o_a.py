"""DeepSeek-V4's grouped output projection (o_a_proj) in one launch (`ops.grouped_linear`) equals
the form it replaces, one matmul a group: the tiny V4 model's logits with either o_a path, for
float weights and for FP8 block-scaled weights (the checkpoint in V4-Flash's formats), on the
torch references (CPU, float32)."""

from __future__ import annotations

import pytest
import torch

from pdserve.model import ops
from pdserve.model.deepseek_v4.attention import GroupedLinear
from pdserve.model.deepseek_v4.loader import load_v4_model
from pdserve.tiny_model import make_tiny_model, quantize_tiny_v4
from tests.helpers.v4_pool import PoolRunner

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("restore_torch_threads")]

IDS = torch.arange(4, 37)  # 33 tokens: past the tiny window and both compression rates


def per_group(self: GroupedLinear, x: torch.Tensor) -> torch.Tensor:
    """The replaced form: x [T, G, in/G] -> [T, G*Ro], one matmul (or fp8_linear) a group."""
    Ro = self.rows
    w = self.weight
    if self.fp8_block is None:
        return torch.cat([x[:, g] @ w[g * Ro : (g + 1) * Ro].t() for g in range(self.groups)], dim=-1)
    sr = Ro // self.fp8_block[0]
    s = self.weight_scale_inv
    return torch.cat(
        [
            ops.fp8_linear(x[:, g], w[g * Ro : (g + 1) * Ro], s[g * sr : (g + 1) * sr], self.fp8_block)
            for g in range(self.groups)
        ],
        dim=-1,
    )


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("v4_o_a")
    tiny = make_tiny_model(root / "float", arch="deepseek_v4", seed=3)
    quant, _ = quantize_tiny_v4(tiny, root / "quant", root / "ref", block=(32, 32))
    return {"float": tiny, "fp8": quant}


def _logits(model) -> torch.Tensor:
    pool = PoolRunner(model)
    return pool.compute_logits(pool(IDS, [len(IDS)], [pool.new_sequence()]))


@pytest.mark.parametrize("kind", ["float", "fp8"])
def test_logits_equal_the_per_group_form(ckpts, kind, monkeypatch):
    model = load_v4_model(ckpts[kind], dtype=torch.float32)
    o_a = model.model.layers[0].self_attn.o_a_proj
    assert o_a.groups > 1 and (o_a.weight.dtype == torch.float8_e4m3fn) == (kind == "fp8")
    new = _logits(model)
    monkeypatch.setattr(GroupedLinear, "forward", per_group)
    old = _logits(model)
    err = ((new - old).abs().max() / old.abs().max()).item()
    assert err < 1e-5, f"{kind}: logits differ by {err:.1e} (relative to the largest)"


@pytest.mark.parametrize("kind", ["float", "fp8"])
@pytest.mark.parametrize("T", [1, 3, 7])
def test_module_equals_the_per_group_form(ckpts, kind, T):
    """One layer's o_a_proj on fresh inputs, new == old, including T = 1 (decode)."""
    model = load_v4_model(ckpts[kind], dtype=torch.float32)
    o_a = model.model.layers[1].self_attn.o_a_proj
    x = torch.randn(T, o_a.groups, o_a.weight.shape[1], generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        new, old = o_a(x), per_group(o_a, x)
    assert new.shape == old.shape == (T, o_a.groups * o_a.rows)
    assert torch.allclose(new, old, rtol=1e-5, atol=1e-6)
