"""A request's sequences as the engine makes them: the Sequence with what it needs beyond the
request (its grammar's matcher, its incremental detokenizer, its token limit, its group when the
request asks for several answers) and, when such a sequence forks, its children (forks.py)."""

from __future__ import annotations

from pdserve.engine.forks import child_params, ranking_params
from pdserve.engine.request import Request
from pdserve.engine.sequence import SeqGroup, Sequence
from pdserve.sampling_params import SamplingParams
from pdserve.structured.matcher import RequestMatcher


class SequenceMaker:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer  # None: skip_tokenizer_init
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def make(self, request: Request, arrival: int, peer=None) -> Sequence:
        """The request's first (or only) sequence; ValueError when its grammar is rejected."""
        params = request.params
        seq = self._sequence(request, ranking_params(params), arrival, peer)
        if params.num_seqs > 1:
            seq.fork_at = len(request.prompt_token_ids) - 1
            if not request.hold_kv:  # a prefill worker hands the prompt off before the fork
                seq.group = SeqGroup(request.request_id, params.n, params.num_seqs, [seq], params.logprobs is None)
        return seq

    def child(self, parent: Sequence, index: int, arrival: int) -> Sequence:
        """parent's index-th sibling, as parent was before the fork (its blocks: BlockManager.fork)."""
        child = self._sequence(parent.request, child_params(parent.params, index), arrival, None)
        child.request_id = f"{parent.request_id}#{index}"
        child.index, child.group = index, parent.group
        child.hold_kv, child.kv_handle, child.first_token = False, None, None
        return child

    def _sequence(self, request: Request, params: SamplingParams, arrival: int, peer) -> Sequence:
        grammar = self._grammar(params)
        seq = Sequence(request, arrival=arrival, peer=peer)
        seq.params = params
        seq.logprobs = [] if params.logprobs is not None else None
        seq.token_limit = min(seq.token_limit, self.max_model_len)
        seq.grammar = grammar
        if self.tokenizer is not None and params.detokenize:
            from pdserve.tokenizer import IncrementalDetokenizer

            seq.detokenizer = IncrementalDetokenizer(
                self.tokenizer, skip_special_tokens=params.skip_special_tokens, prompt_token_ids=seq.prompt_token_ids
            )
        return seq

    def _grammar(self, params: SamplingParams) -> RequestMatcher | None:
        """The request's matcher (its spec compiled once per engine, then cached); ValueError when
        the grammar library rejects the spec."""
        spec = params.structured_outputs
        if spec is None:
            return None
        if self.tokenizer is None:
            raise ValueError("structured outputs need a tokenizer (this engine has skip_tokenizer_init)")
        from pdserve.structured.compiler import compiler_for

        compiler = compiler_for(self.tokenizer, self.vocab_size, sorted(self.eos_token_ids))
        return RequestMatcher(compiler.compile(spec), spec)
