"""MTP drafts against transformers' own MTP (modeling_layers.MtpModel), tiny V3 and V3.2, float32.

pdserve's engine runs one greedy request with speculative method "mtp" (k = 3; a 16-token step
budget, so the 24-token prompt prefills in two chunks and the MTP pass crosses the chunk; 4-token
blocks, so the chain grows the block table). After each step its drafts and draft logits are
recorded; in one run they are then replaced by the target's own continuation, so verify steps
accept every draft and the next pass covers several positions, in the other they are verified as
they are (random weights: rejected), so the chain's records past the kept positions must leave no
trace in later drafts. For each recorded state (tokens t_0..t_m) the oracle
recomputes from scratch, through transformers only: the main model's last hidden states h_0..h_{m-1}
(after the final norm), `MtpModel.forward_layer` over (h_i, t_{i+1}), the draft argmax of the last
row's logits, then the same layer chained on its own output with each draft. Draft tokens must be
equal and every draft logit row close.

transformers' MtpModel loads the layer by the pattern in the main model's
`_keys_to_ignore_on_load_unexpected` (the 61-layer releases'), so the tiny model's index is put
there. Its DeepseekV32 config has no `num_mtp_layers` / `mtp_layer_types` (V3's config maps the
first to num_nextn_predict_layers) and its mask table lacks V3.2's "indexed_attention"; the test
sets those config fields and gives MtpModel the causal mask V3.2's own model builds
(`create_causal_mask(..., allow_is_causal_skip=False)`), transformers' code throughout.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.tiny_model import make_tiny_model
from tests.helpers.mtp_drafts import record_drafts

pytestmark = pytest.mark.timeout(600)

K = 3
PROMPT = [(7 * i + 3) % 200 + 2 for i in range(24)]  # > V3.2's index_topk (16): the sparse path
MAX_TOKENS = 12


def _hf(path: str):
    from transformers import AutoModelForCausalLM
    from transformers.modeling_layers import MtpModel

    main = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = main.config
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{cfg.num_hidden_layers}\..*"]
    v32 = cfg.model_type == "deepseek_v32"
    if v32:
        cfg.num_mtp_layers = cfg.num_nextn_predict_layers
        cfg.mtp_layer_types, cfg.mtp_mlp_layer_types = ["indexed_attention"], ["sparse"]
    mtp = MtpModel.from_pretrained(main).eval()
    if v32:
        from transformers.masking_utils import create_causal_mask

        def masks(layer_idx, inputs_embeds, mtp_cache, position_ids):
            mask = create_causal_mask(
                config=mtp.config, inputs_embeds=inputs_embeds, attention_mask=None, cache=mtp_cache,
                position_ids=position_ids, layer_idx=layer_idx, allow_is_causal_skip=False,
            )  # fmt: skip
            return {"attention_mask": mask}

        mtp.create_masks_for_mtp_layer = masks
    return main, mtp


@torch.no_grad()
def _oracle(main, mtp, tokens: list[int], k: int) -> tuple[list[int], torch.Tensor]:
    """Drafts and their logits [k, V] for a sequence t_0..t_m, from scratch."""
    from transformers.cache_utils import MtpCache

    m = len(tokens) - 1
    ids = torch.tensor([tokens])
    h = main(ids[:, :m], output_hidden_states=True).hidden_states[-1]  # [1, m, H] after the final norm
    cache = MtpCache(config=main.config.get_mtp_config())
    # transformers' MTP runs the pair (h_i, t_{i+1}) at position i + 1; pdserve at i (rope is relative)
    g = mtp.forward_layer(0, h, torch.arange(1, m + 1)[None], cache, input_ids=ids[:, 1:])[:, -1:]
    drafts, logits = [], []
    for j in range(k):
        lg = mtp._project_to_logits(g)[0, -1].float()
        logits.append(lg)
        drafts.append(int(lg.argmax()))
        if j + 1 < k:
            g = mtp.forward_layer(0, g, torch.tensor([[m + 1 + j]]), cache, input_ids=torch.tensor([[drafts[-1]]]))
    return drafts, torch.stack(logits)


@pytest.mark.parametrize("forced", [True, False], ids=["accepted", "as_drafted"])
@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v32"])
def test_mtp_drafts_match_transformers(arch, forced, tmp_path):
    path = str(make_tiny_model(tmp_path / arch, arch))
    seen = record_drafts(path, PROMPT, MAX_TOKENS, K, forced)
    main, mtp = _hf(path)
    for tokens, drafts, logits in seen:
        want, want_logits = _oracle(main, mtp, tokens, len(drafts))
        assert drafts == want, f"after {len(tokens)} tokens"
        torch.testing.assert_close(logits, want_logits, atol=2e-4, rtol=1e-3)
