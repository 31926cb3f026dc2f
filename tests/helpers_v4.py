"""What the DeepSeek-V4 engine tests share: prompt lengths around the tiny model's rates (CSA 4,
HCA 16) and window (8), an engine on the tiny checkpoint, and a run-to-completion loop."""

from __future__ import annotations

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import Request
from pdserve.sampling_params import SamplingParams

PROMPT_LENS = (3, 4, 7, 8, 9, 15, 16, 17, 31, 33)
NEW_TOKENS = [4 + (i * 7) % 15 for i in range(len(PROMPT_LENS))]  # 4..18: decode crosses 8, 16, 32, 48


def engine(tiny, connector=None, **kw) -> LLMEngine:
    cfg = dict(model=str(tiny), dtype="float32", kv_block_size=8, num_kv_blocks=256, skip_tokenizer_init=True)
    return LLMEngine(EngineConfig(**{**cfg, **kw}), connector)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def run(eng: LLMEngine, requests: list[Request]) -> dict[str, list[int]]:
    for r in requests:
        eng.add_request(r)
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return done


def requests(prompts, **kw) -> list[Request]:
    return [Request(request_id=str(i), prompt_token_ids=p, params=greedy(n), **kw) for i, (p, n) in enumerate(zip(prompts, NEW_TOKENS))]
