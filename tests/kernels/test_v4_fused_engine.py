"""The tiny DeepSeek-V4 through the engine on the GPU's paths (every `ops` call on its Triton kernel,
interpreted on CPU: the fused glue, the compressor's decode kernel, the decode and chunk steps'
metadata, attention, MoE) against the same engine on the torch paths the CPU tests check against
transformers: the same greedy tokens over decodes that cross the compressors' group edges (rates
4 and 16), float32; and with n-gram drafts, whose verify steps take the chunk step's kernels, the
same tokens as plain decoding on the torch paths.

TRITON_INTERPRET is set before triton's first import, as in the other kernel tests."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from pdserve.model import ops  # noqa: E402
from pdserve.tiny_model import make_tiny_model  # noqa: E402
from tests.helpers.kernels import require_interpreter  # noqa: E402
from tests.helpers.v4 import engine, greedy, run  # noqa: E402

pytestmark = pytest.mark.timeout(900)
require_interpreter()
from pdserve.engine.request import Request  # noqa: E402


class _Drafts:
    """The target's own next tokens but one (the j-th of the i-th call, j = i % (k + 1); j = k: all
    right): verify chunks of every accepted length."""

    def __init__(self, prompts, expected, k: int) -> None:
        self.expected, self.k, self.calls = {tuple(p): e for (p, _), e in zip(prompts, expected)}, k, 0

    def propose(self, seq, limit: int) -> list[int]:
        nxt = self.expected[tuple(seq.prompt_token_ids)][seq.num_output_tokens : seq.num_output_tokens + limit]
        self.calls += 1
        return [t if i != self.calls % (self.k + 1) else t + 1 for i, t in enumerate(nxt)]


def _tokens(tiny, prompts, backend: str, drafts: _Drafts | None = None, **kw) -> list[list[int]]:
    ops.set_backend(backend)
    try:
        eng = engine(tiny, max_num_seqs=4, **kw)
        if drafts is not None:
            eng.spec.proposer = drafts
        reqs = [Request(request_id=str(i), prompt_token_ids=p, params=greedy(n)) for i, (p, n) in enumerate(prompts)]
        done = run(eng, reqs)
        assert drafts is None or eng.spec.stats.num_drafts > 0, "no verify step"
    finally:
        ops.set_backend(None)
    return [done[str(i)].outputs[0].token_ids for i in range(len(prompts))]


def _counted(monkeypatch, module, name: str, calls: dict) -> None:
    fn = getattr(module, name)

    def wrapped(*a, **kw):
        calls[name] = calls.get(name, 0) + 1
        return fn(*a, **kw)

    monkeypatch.setattr(module, name, wrapped)


def test_greedy_tokens_equal_on_the_fused_paths(tmp_path, monkeypatch):
    from pdserve_kernels import compress, glue, mhc, v4_chunk_step, v4_step

    calls: dict = {}
    for module, name in (
        (mhc, "hc_pre"),
        (mhc, "hc_post"),
        (glue, "route"),
        (glue, "rms_norm_rope"),
        (glue, "swiglu"),
        (compress, "compress_decode"),
        (v4_step, "window_rope"),
        (v4_step, "rate_entries"),
        (v4_chunk_step, "chunk_window_rope"),
        (v4_chunk_step, "chunk_rate_entries"),
    ):
        _counted(monkeypatch, module, name, calls)
    tiny = make_tiny_model(tmp_path / "tiny", arch="deepseek_v4", seed=0)
    g = torch.Generator().manual_seed(11)
    # lengths around the rates: decodes cross 4-token groups and the 16-token HCA group
    prompts = [(torch.randint(4, 800, (n,), generator=g).tolist(), new) for n, new in ((3, 9), (14, 6), (7, 5))]
    want = _tokens(tiny, prompts, "torch")
    assert not calls, "the torch paths call no kernel"
    got = _tokens(tiny, prompts, "triton")
    kernels = {
        "hc_pre",
        "hc_post",
        "route",
        "rms_norm_rope",
        "swiglu",
        "compress_decode",
        "window_rope",
        "rate_entries",
        "chunk_window_rope",
        "chunk_rate_entries",
    }
    assert set(calls) == kernels, calls
    assert got == want


def test_verify_steps_on_the_chunk_kernels_equal_plain_decoding(tmp_path, monkeypatch):
    from pdserve_kernels import v4_chunk_step

    calls: dict = {}
    _counted(monkeypatch, v4_chunk_step, "chunk_rate_entries", calls)
    tiny = make_tiny_model(tmp_path / "tiny", arch="deepseek_v4", seed=0)
    prompts = [(list(range(10, 16)), 5)]  # verify chunks across a 4-token group and the window (8)
    want = _tokens(tiny, prompts, "torch")
    spec = {"method": "ngram", "num_speculative_tokens": 2}  # its proposer replaced by _Drafts
    got = _tokens(tiny, prompts, "triton", _Drafts(prompts, want, 2), speculative_config=spec)
    assert calls and got == want
