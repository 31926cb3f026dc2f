"""make_tiny_model: loads in transformers 5.24 with every weight used, deterministic per seed."""

import json

import pytest
import torch
import transformers
from safetensors import safe_open

from pdserve.tiny_model import make_tiny_model

pytestmark = pytest.mark.timeout(300)

FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


ARCHS = ("deepseek_v3", "deepseek_v32")  # deepseek_v4's tiny model: tests/unit/test_deepseek_v4.py


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request, tmp_path_factory):
    arch = request.param
    return arch, make_tiny_model(tmp_path_factory.mktemp(arch), arch=arch, seed=0)


def _load(folder, **overrides):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, output_loading_info=True, **overrides
    )
    return model.eval(), info


def test_transformers_loads_every_weight(tiny):
    arch, folder = tiny
    model, info = _load(folder)
    # the MTP layer (model.layers.{L}.*) is not part of transformers' causal LM: its MtpModel loads
    # it (test_mtp_oracle.py)
    mtp = f"model.layers.{model.config.num_hidden_layers}."
    assert info["unexpected_keys"] and all(k.startswith(mtp) for k in info["unexpected_keys"])
    assert info["missing_keys"] == set()
    assert info["mismatched_keys"] == set() and info["error_msgs"] == []
    assert model.config.model_type == arch
    expected = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v32": "DeepseekV32ForCausalLM"}[arch]
    assert type(model).__name__ == expected
    # Every tensor in the file is a parameter transformers built, and every parameter is in the file.
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        on_disk = set(f.keys())
        assert all(f.get_slice(k).get_dtype() == "F32" for k in on_disk)
    saved = _saved_names(model, folder.parent / f"{arch}-resaved")
    assert {k for k in on_disk if not k.startswith(mtp)} == saved


def _saved_names(model, out) -> set[str]:
    model.save_pretrained(out)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_forward_is_finite_and_uses_moe_and_yarn(tiny):
    arch, folder = tiny
    model, _ = _load(folder)
    config = json.loads((folder / "config.json").read_text())
    assert config["rope_parameters"]["rope_type"] == "yarn"
    assert config["first_k_dense_replace"] < config["num_hidden_layers"]
    ids = torch.arange(4, 44).unsqueeze(0)  # 40 tokens: longer than V3.2's index_topk (16)
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 40, config["vocab_size"])
    assert torch.isfinite(logits).all()
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.abs().sum() > 0
    if arch == "deepseek_v32":
        # The sparse path is really taken: with top-k >= context it becomes dense and logits change.
        dense, _ = _load(folder, index_topk=4096)
        with torch.no_grad():
            assert not torch.allclose(dense(ids).logits, logits, atol=1e-5)


def test_greedy_output_is_not_one_repeated_token(tiny):
    _, folder = tiny
    model, _ = _load(folder)
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    prompt = tok("The capital of France is", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=16, do_sample=False)
    new = out[0, prompt.input_ids.shape[1] :].tolist()
    assert len(set(new)) > 2, new


def test_config_and_tokenizer_agree(tiny):
    _, folder = tiny
    config = json.loads((folder / "config.json").read_text())
    tok = transformers.AutoTokenizer.from_pretrained(folder)
    assert config["vocab_size"] >= len(tok) and config["vocab_size"] % 128 == 0
    assert (config["bos_token_id"], config["eos_token_id"]) == (tok.bos_token_id, tok.eos_token_id)
    generation = json.loads((folder / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (tok.bos_token_id, tok.eos_token_id)


def test_same_seed_gives_identical_files(tmp_path):
    a = make_tiny_model(tmp_path / "a", arch="deepseek_v32", seed=7)
    b = make_tiny_model(tmp_path / "b", arch="deepseek_v32", seed=7)
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_different_seeds_change_weights_only(tmp_path):
    a = make_tiny_model(tmp_path / "a", seed=0)
    b = make_tiny_model(tmp_path / "b", seed=1)
    assert (a / "model.safetensors").read_bytes() != (b / "model.safetensors").read_bytes()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_unknown_arch_is_refused(tmp_path):
    with pytest.raises(ValueError, match="unknown arch 'llama'.*deepseek_v3, deepseek_v32"):
        make_tiny_model(tmp_path, arch="llama")
