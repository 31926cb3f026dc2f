"""The offline API, in vLLM's shapes:

from pdserve import LLM, SamplingParams
llm = LLM(model="/path/to/checkpoint", device="cpu")
out = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=8))
print(out[0].outputs[0].text, out[0].outputs[0].token_ids)
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from pdserve.config import resolve_model
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.request import Request
from pdserve.outputs import RequestOutput
from pdserve.sampling_params import RequestOutputKind, SamplingParams

Message = dict[str, Any]


class LLM:
    def __init__(
        self,
        model: str,
        device: str = "cpu",
        dtype: str = "auto",
        max_num_seqs: int = 256,
        kv_block_size: int = 64,
        skip_tokenizer_init: bool = False,
        seed: int = 0,
        **engine_kwargs: Any,
    ) -> None:
        """model: a checkpoint folder, or 'tiny:<arch>' (the tiny random model, made in the cache on
        first use). engine_kwargs: any other EngineConfig field (num_kv_blocks, max_model_len, ...)."""
        config = EngineConfig(
            model=resolve_model(model),
            device=device,
            dtype=dtype,
            max_num_seqs=max_num_seqs,
            kv_block_size=kv_block_size,
            skip_tokenizer_init=skip_tokenizer_init,
            seed=seed,
            **engine_kwargs,
        )
        self.engine = LLMEngine(config)
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | dict | Sequence[str | dict] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: list[int] | list[list[int]] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """prompts: text, or {"prompt": text} / {"prompt_token_ids": ids}, or a list of those;
        or prompt_token_ids: one id list or a list of them. Returns outputs in input order."""
        inputs = self._inputs(prompts, prompt_token_ids)
        return self._run(inputs, sampling_params, use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """One conversation (a list of {"role", "content"}) or a list of conversations, rendered
        with the checkpoint's chat template."""
        tok = self._tokenizer("chat")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        inputs = []
        for conv in conversations:
            text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
            inputs.append((text, tok.encode(text, add_special_tokens=False)))
        return self._run(inputs, sampling_params, use_tqdm)

    # -- helpers --
    def _tokenizer(self, what: str):
        if self.engine.tokenizer is None:
            raise ValueError(f"{what} needs a tokenizer, but this LLM was made with skip_tokenizer_init=True")
        return self.engine.tokenizer

    def _inputs(self, prompts, prompt_token_ids) -> list[tuple[str | None, list[int]]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompts or prompt_token_ids")
        if prompt_token_ids is not None:
            if prompt_token_ids and isinstance(prompt_token_ids[0], int):
                prompt_token_ids = [prompt_token_ids]
            return [(None, list(ids)) for ids in prompt_token_ids]
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        return [self._one_input(p) for p in prompts]

    def _one_input(self, p: str | dict) -> tuple[str | None, list[int]]:
        if isinstance(p, dict):
            if "prompt_token_ids" in p:
                return p.get("prompt"), list(p["prompt_token_ids"])
            if "prompt" not in p:
                raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
            p = p["prompt"]
        if not isinstance(p, str):
            raise ValueError(f"a prompt must be a string or a dict, got {type(p).__name__}")
        return p, self._tokenizer("a text prompt").encode(p)

    def _run(self, inputs, sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (
            [sampling_params] * len(inputs) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        )
        if len(params) != len(inputs):
            raise ValueError(f"{len(params)} sampling params for {len(inputs)} prompts")
        ids: list[str] = []
        try:
            for (text, token_ids), p in zip(inputs, params):
                p = p.model_copy(update={"output_kind": RequestOutputKind.FINAL_ONLY})  # one output each, at the end
                request_id = str(next(self._counter))
                self.engine.add_request(
                    Request(request_id=request_id, prompt_token_ids=token_ids, params=p, prompt=text)
                )
                ids.append(request_id)
            return self._drain(ids, use_tqdm)
        except BaseException:
            # leave the engine empty for the next call (bad input, Ctrl-C, a model error)
            for request_id in ids:
                self.engine.abort_request(request_id)
            self.engine.step()
            raise

    def _drain(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(ids), desc="Processed prompts")
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        done[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        return [done[i] for i in ids]
