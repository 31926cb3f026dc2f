"""DeepSeek-V4's MTP drafts against an oracle built from transformers' own V4 pieces, tiny V4, float32.

transformers 5.24 has no V4 MTP (its DeepseekV4 model ignores `mtp.*` on load), so the oracle is
composed here, as DeepSeek's reference `MTPBlock` computes it:

- from transformers: the main model (`AutoModelForCausalLM`, float32) and its residual streams
  before `hc_head` (a forward pre-hook on `model.hc_head`); its embedding `embed_tokens` and
  `lm_head`; a `DeepseekV4DecoderLayer` built at index num_hidden_layers of a config whose
  `layer_types` / `mlp_layer_types` lists gain the MTP layer's entries (sliding_attention, moe),
  its weights `mtp.0.*` renamed by transformers' own deepseek_v4 checkpoint renamings
  (`get_checkpoint_conversion_mapping`; the routed experts stacked here, as its converter
  stacks them); its rotary embedding and sliding-window causal mask as the model builds them;
  `DeepseekV4RMSNorm` for enorm / hnorm / norm and `DeepseekV4HyperHead` for the MTP hc_head,
  each loaded with the layer's own weights.
- written here, in plain torch: `e_proj` / `h_proj` (F.linear), the sum
  `e_proj(enorm(embed(t_{i+1})))[:, None] + h_proj(hnorm(h_i))` over the N streams, and the
  chaining (row i at position i pairs the target's streams h_i with t_{i+1}; each chained row
  pairs the layer's own output streams with the draft before it). Every sequence is recomputed
  from scratch, without a cache.

pdserve's engine runs one greedy request with method "mtp" (k = 3; a 16-token step budget so the
24-token prompt prefills in two chunks; 4-token blocks so the chain grows the tables). After each
step its drafts and draft logits are recorded; in one run the drafts are then replaced by the
target's continuation (every draft accepted), in the other verified as drafted (random weights:
rejected, so the chain's window records past the kept positions must leave no trace).
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from pdserve.tiny_model import make_tiny_model
from tests.helpers.mtp_drafts import record_drafts

pytestmark = pytest.mark.timeout(600)

K = 3
PROMPT = [(7 * i + 3) % 200 + 2 for i in range(24)]  # crosses the window (8) and both compress rates
MAX_TOKENS = 14


class _Oracle:
    def __init__(self, path: str) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.conversion_mapping import WeightRenaming, get_checkpoint_conversion_mapping
        from transformers.masking_utils import create_sliding_window_causal_mask
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as mod

        self.main = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.mask = create_sliding_window_causal_mask
        cfg = self.main.config
        n, H = cfg.num_hidden_layers, cfg.hidden_size
        self.cfg = copy.deepcopy(cfg)
        self.cfg.layer_types = [*cfg.layer_types, "sliding_attention"]
        self.cfg.mlp_layer_types = [*cfg.mlp_layer_types, "moe"]
        w = {
            k.removeprefix("mtp.0."): v
            for k, v in load_file(f"{path}/model.safetensors").items()
            if k.startswith("mtp.0.")
        }
        own = ("e_proj.weight", "h_proj.weight", "enorm.weight", "hnorm.weight", "norm.weight")
        own += ("hc_head_fn", "hc_head_base", "hc_head_scale")
        self.w = {k: w.pop(k) for k in own}
        renames = [r for r in get_checkpoint_conversion_mapping("deepseek_v4") if isinstance(r, WeightRenaming)]
        state, experts = {}, {}
        for name, t in w.items():
            m = re.match(r"ffn\.experts\.(\d+)\.(w[123])\.weight$", name)
            if m:
                experts[int(m.group(1)), m.group(2)] = t
                continue
            name = f"layers.{n}.{name}"
            for r in renames:
                name = re.sub(r.source_patterns[0], r.target_patterns[0].replace("\\", ""), name)
            state[name.removeprefix(f"layers.{n}.")] = t
        E = cfg.n_routed_experts
        state["mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([experts[e, "w1"], experts[e, "w3"]]) for e in range(E)]
        )
        state["mlp.experts.down_proj"] = torch.stack([experts[e, "w2"] for e in range(E)])
        self.layer = mod.DeepseekV4DecoderLayer(self.cfg, n).float().eval()
        self.layer.load_state_dict(state, strict=True)
        self.norms = {}
        for key in ("enorm", "hnorm", "norm"):
            self.norms[key] = mod.DeepseekV4RMSNorm(H, eps=cfg.rms_norm_eps).float()
            self.norms[key].weight.data.copy_(self.w[f"{key}.weight"])
        self.hc_head = mod.DeepseekV4HyperHead(cfg).float()
        for p in ("fn", "base", "scale"):
            getattr(self.hc_head, f"hc_{p}").data.copy_(self.w[f"hc_head_{p}"])

    @torch.no_grad()
    def streams(self, tokens: list[int]) -> torch.Tensor:
        """The target's residual streams before hc_head [1, S, N, H] over tokens."""
        seen = []
        hook = self.main.model.hc_head.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
        self.main(torch.tensor([tokens]))
        hook.remove()
        return seen[0]

    @torch.no_grad()
    def layer_out(self, h: torch.Tensor, next_ids: list[int]) -> torch.Tensor:
        """The MTP layer over rows 0..S-1 (streams h [1, S, N, H], tokens next_ids) -> [1, S, N, H]."""
        ids = torch.tensor([next_ids])
        e = F.linear(self.norms["enorm"](self.main.model.embed_tokens(ids)), self.w["e_proj.weight"])  # [1, S, H]
        x = F.linear(self.norms["hnorm"](h), self.w["h_proj.weight"]) + e[:, :, None, :]
        pos = torch.arange(ids.shape[1])[None]
        rotary = self.main.model.rotary_emb
        pe = {kind: rotary(e, position_ids=pos, layer_type=kind) for kind in ("main", "compress")}
        mask = self.mask(config=self.cfg, inputs_embeds=e, attention_mask=None, cache=None, position_ids=pos)
        return self.layer(x, position_embeddings=pe, position_ids=pos, attention_mask=mask, input_ids=ids)

    @torch.no_grad()
    def drafts(self, tokens: list[int], k: int) -> tuple[list[int], torch.Tensor]:
        """Drafts and their logits [k, V] for a sequence t_0..t_m, from scratch."""
        m = len(tokens) - 1
        h, nxt = self.streams(tokens[:m]), list(tokens[1:])  # rows 0..m-1
        drafts, logits = [], []
        for _ in range(k):
            g = self.layer_out(h, nxt)  # [1, S, N, H]
            lg = self.main.lm_head(self.norms["norm"](self.hc_head(g[:, -1:])))[0, -1].float()
            logits.append(lg)
            drafts.append(int(lg.argmax()))
            h, nxt = torch.cat([h, g[:, -1:]], dim=1), nxt + [drafts[-1]]
        return drafts, torch.stack(logits)


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    path = str(make_tiny_model(tmp_path_factory.mktemp("v4"), "deepseek_v4"))
    return path, _Oracle(path)


@pytest.mark.parametrize("forced", [True, False], ids=["accepted", "as_drafted"])
def test_v4_mtp_drafts_match_the_oracle(v4, forced):
    path, oracle = v4
    seen = record_drafts(path, PROMPT, MAX_TOKENS, K, forced)
    for tokens, drafts, logits in seen:
        want, want_logits = oracle.drafts(tokens, len(drafts))
        assert drafts == want, f"after {len(tokens)} tokens"
        torch.testing.assert_close(logits, want_logits, atol=2e-4, rtol=1e-3)
