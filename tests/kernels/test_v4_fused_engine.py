"""The tiny DeepSeek-V4 through the engine on the GPU's paths (every `ops` call on its Triton kernel,
interpreted on CPU: the fused glue, the compressor's decode and chunk kernels, the decode and chunk
steps' metadata, attention, MoE) against the same engine on the torch paths the CPU tests check
against transformers: the same greedy tokens over decodes that cross the compressors' group edges
(rates 4 and 16), float32; and with drafts, whose verify steps take the chunk kernels, the same
tokens as plain decoding on the torch paths.

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


def _tokens(tiny, prompts, backend: str, eng=None) -> list[list[int]]:
    ops.set_backend(backend)
    try:
        eng = eng or engine(tiny, max_num_seqs=4)
        reqs = [Request(request_id=str(i), prompt_token_ids=p, params=greedy(n)) for i, (p, n) in enumerate(prompts)]
        done = run(eng, reqs)
    finally:
        ops.set_backend(None)
    return [done[str(i)].outputs[0].token_ids for i in range(len(prompts))]


def _counted(monkeypatch, module, name: str, calls: dict) -> None:
    fn = getattr(module, name)

    def wrapped(*a, **kw):
        calls[name] = calls.get(name, 0) + 1
        return fn(*a, **kw)

    monkeypatch.setattr(module, name, wrapped)


class _Drafts:
    """The target's own next tokens (from a plain run) with one wrong at a cycling place: every
    accepted length 0..k, so verify chunks' records are both kept and recomputed. No drafts for a
    sequence's first `plain` tokens: the steps after the prefill are plain decode steps (the decode
    kernels)."""

    def __init__(self, prompts, expected, k: int, plain: int) -> None:
        self.expected, self.k, self.plain = {tuple(p): e for (p, _), e in zip(prompts, expected)}, k, plain
        self.calls = 0

    def propose(self, seq, limit: int) -> list[int]:
        if seq.num_output_tokens < self.plain:
            return []
        nxt = self.expected[tuple(seq.prompt_token_ids)][seq.num_output_tokens :][:limit]
        self.calls += 1
        return [t if i != self.calls % (self.k + 1) else t + 1 for i, t in enumerate(nxt)]


def test_greedy_tokens_equal_on_the_fused_paths(tmp_path, monkeypatch):
    """Plain decode steps (the decode kernels), then verify chunks (k = 2: the compressors'
    two-kernel update with records into spare slots, the chunk step's metadata kernels; the
    prefill takes them too) on the Triton paths give plain decoding's tokens on the torch paths."""
    from pdserve_kernels import compress, glue, mhc, v4_chunk_step, v4_step

    calls: dict = {}
    kernels = (
        (mhc, "hc_pre"),
        (mhc, "hc_post"),
        (glue, "route"),
        (glue, "rms_norm_rope"),
        (glue, "swiglu"),
        (compress, "compress_decode"),
        (compress, "compress_chunk"),
        (v4_step, "window_rope"),
        (v4_step, "rate_entries"),
        (v4_chunk_step, "chunk_window_rope"),
        (v4_chunk_step, "chunk_rate_entries"),
    )
    for module, name in kernels:
        _counted(monkeypatch, module, name, calls)
    spare = []
    chunk = compress.compress_chunk
    monkeypatch.setattr(compress, "compress_chunk", lambda *a: spare.append(a[4] is not a[3]) or chunk(*a))
    tiny = make_tiny_model(tmp_path / "tiny", arch="deepseek_v4", seed=0)
    g = torch.Generator().manual_seed(11)
    # lengths around the rates: decodes and verify chunks cross 4-token groups and the 16-token HCA group
    prompts = [(torch.randint(4, 800, (n,), generator=g).tolist(), new) for n, new in ((3, 9), (14, 6))]
    want = _tokens(tiny, prompts, "torch")
    assert not calls, "the torch paths call no kernel"
    eng = engine(tiny, max_num_seqs=4, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    eng.spec.proposer = _Drafts(prompts, want, 2, plain=3)
    assert _tokens(tiny, prompts, "triton", eng) == want
    assert set(calls) == {name for _, name in kernels}, calls
    stats, kept = eng.spec.stats, eng.spec.spare
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens and kept.num_kept > 0 and kept.num_recomputes > 0
    assert any(spare)
