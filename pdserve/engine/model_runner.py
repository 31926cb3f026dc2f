"""The only engine file that touches torch: loads the model, owns the KV cache, turns a
SchedulerOutput into one ForwardBatch, runs the model and samples.

Legend: T tokens in the step, C longest context in the step, N sequences that sample.

Tensor parallelism (config.tensor_parallel_size > 1): this runner is rank 0. It starts ranks
1..N-1 (pdserve.engine.tp_ranks), each a ModelRunner of its own shard in `serve_forever()`.
Each step rank 0 broadcasts the step's StepInputs, every rank builds the same ForwardBatch and
runs the forward (all-reduces inside), and rank 0 alone computes logits and samples (MTP drafts:
`run_mtp`, the MTP layer's forward on every rank, its hidden-state input broadcast). The KV cache
is replicated: every rank writes the same records (V3's latent, each of V4's regions); KV that
arrives from a prefill worker lands in rank 0's cache (the one the KV connector registered) and
`on_kv_loaded` copies what it loaded of every region (token blocks, window blocks, state slot) to
the other ranks.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable

import torch

from pdserve.distributed.group import TPGroup
from pdserve.engine import step_tables
from pdserve.engine import tp_protocol as protocol
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import DEFAULT_CPU_KV_GB, EngineConfig
from pdserve.engine.cuda_graphs import CudaGraphRunner, all_decode_rows, graph_ladder, verified_drafts
from pdserve.engine.launched_step import LaunchedStep, feed_from
from pdserve.engine.memory import MemoryFigures, measure_figures, plan_kv_pool, profile_peak
from pdserve.engine.model_loading import check_shardable, load_for_engine
from pdserve.engine.prefix_checkpoints import checkpoint_capacity, window_blocks_per_checkpoint
from pdserve.engine.sampler import SampledToken, Sampler
from pdserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.engine.sequence import Sequence
from pdserve.engine.spec_decode import verify
from pdserve.engine.spec_decode.mtp_handoff import row_shape
from pdserve.model.batch import ForwardBatch, StepInputs
from pdserve.model.kv_cache import STATE, WINDOW, KVCache, KVRegionSpec

log = logging.getLogger("pdserve.engine")


def plans_memory(device: torch.device) -> bool:
    """Whether the pool is planned in device memory (engine/memory.py): on CUDA; on CPU it is the
    configured size."""
    return device.type == "cuda"


def _ids(v: int | list[int] | None) -> set[int]:
    return set() if v is None else {v} if isinstance(v, int) else set(v)


class ModelRunner:
    keep_hidden = False  # keep each step's hidden states in last_hidden (MTP drafting sets it)
    last_hidden: torch.Tensor | None = None

    def __init__(
        self, config: EngineConfig, model: torch.nn.Module | None = None, *, tp: TPGroup | None = None
    ) -> None:
        """model: an already-built model with the DeepseekForCausalLM interface (tests); by default
        the checkpoint in config.model is loaded. tp: given only to ranks 1..N-1 (ranks.py)."""
        self.config = config
        self.ranks = None
        if tp is None and config.tensor_parallel_size > 1:
            if model is not None:
                raise ValueError("a prebuilt model runs with tensor_parallel_size 1 only")
            check_shardable(config)
            from pdserve.engine.tp_ranks import RankProcesses

            self.ranks, tp = RankProcesses.start(config)
            self._finalizer = weakref.finalize(self, self.ranks.kill)  # the last resort; shutdown() is the way
        self.tp = tp or TPGroup.single()
        try:
            self._setup(config, model)
        except BaseException:
            self.shutdown(clean=False)
            raise

    def _setup(self, config: EngineConfig, model: torch.nn.Module | None) -> None:
        self.device = self.tp.device if self.tp.size > 1 else torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" -> "cuda:0": set_device needs an index
            self.device = torch.device("cuda", torch.cuda.current_device())
        if self.device.type == "cpu" and config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        self.dtype = getattr(torch, config.resolved_dtype())
        if model is None:
            model = load_for_engine(config, self.dtype, self.device, self.tp)
        self.model = model
        self.block_size = config.kv_block_size
        max_pos = model.config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > max_pos:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings {max_pos}"
            )
        specs = model.kv_cache_specs(config.kv_cache_dtype)
        self.window_tokens, self.num_window_blocks, self.num_state_slots = _side_spaces(
            specs, config.max_num_seqs, self.block_size
        )
        self.num_checkpoints = checkpoint_capacity(config, specs)  # prefix caching's (DeepSeek-V4)
        if self.num_checkpoints:
            self.num_window_blocks += self.num_checkpoints * window_blocks_per_checkpoint(
                self.window_tokens, self.block_size
            )
            self.num_state_slots += self.num_checkpoints
        side_bytes = sum(
            n * KVCache.bytes_per_block(specs, model.num_layers, self.block_size, self.dtype, space)
            for n, space in ((self.num_window_blocks, WINDOW), (self.num_state_slots, STATE))
        )
        block_bytes = KVCache.bytes_per_block(specs, model.num_layers, self.block_size, self.dtype)
        use_graphs = (
            self.device.type == "cuda"
            and not config.enforce_eager
            and self.tp.size == 1
            and getattr(model, "supports_cuda_graphs", False)
        )
        max_bs, max_chunk, as_chunks, largest = graph_ladder(config, model)
        self.max_chunk = 1 if as_chunks else max_chunk  # > 1: verify steps as decode rows (V3), eager too
        graph_shapes = largest if use_graphs else None  # the largest graphs: the memory plan counts them
        self.memory_figures: MemoryFigures | None = None  # the start-up plan's numbers (CUDA)
        if plans_memory(self.device):
            n = self._planned_blocks(specs, block_bytes, side_bytes, max_pos, graph_shapes)
        else:
            n = self._num_kv_blocks(block_bytes, config.max_model_len or max_pos, side_bytes)
        self.num_kv_blocks = self.tp.min_control(n)  # the block manager's blocks must exist on every rank
        capacity = self.num_kv_blocks * self.block_size
        if config.max_model_len is not None and config.max_model_len > capacity:
            raise ValueError(
                f"max_model_len {config.max_model_len} needs {math.ceil(config.max_model_len / self.block_size)} KV blocks "
                f"but only {self.num_kv_blocks} fit; lower max_model_len or raise num_kv_blocks / kv_cache_memory_gb"
            )
        self.max_model_len = config.max_model_len or min(max_pos, capacity)
        # + the graphs' scratch block in each space the pool has (cuda_graphs.py)
        scratch = [
            n + (1 if use_graphs and n else 0)
            for n in (self.num_kv_blocks, self.num_window_blocks, self.num_state_slots)
        ]
        self.kv_cache = KVCache(
            specs, model.num_layers, scratch[0], self.block_size, self.dtype, self.device, scratch[1], scratch[2]
        )
        self.graphs: CudaGraphRunner | None = None
        if use_graphs:
            self.graphs = CudaGraphRunner(
                model,
                self.kv_cache,
                max_bs=max_bs,
                max_len=self.max_model_len,
                scratch_block=self.num_kv_blocks,
                scratch_window_block=self.num_window_blocks if self.num_window_blocks else -1,
                scratch_state_slot=self.num_state_slots if self.num_state_slots else -1,
                max_chunk=max_chunk,
                max_rows=config.max_num_batched_tokens,
                as_chunks=as_chunks,
            )
            self.graphs.capture()
        self.eos_token_ids = set(model.config.eos_token_ids) | _ids(config.generation_config().get("eos_token_id"))
        self.sampler = Sampler(self.device, config.seed, sorted(self.eos_token_ids), config.logprobs_mode)

    def _planned_blocks(
        self, specs: list[KVRegionSpec], block_bytes: int, side_bytes: int, max_pos: int, graph_shapes: list | None
    ) -> int:
        """CUDA: profile the peak activations, then plan the pool in this worker's share of the GPU
        (engine/memory.py); kv_cache_memory_gb asks for that many blocks."""
        c = self.config
        max_len = c.max_model_len or max_pos
        peak = profile_peak(
            self.model,
            specs,
            block_size=self.block_size,
            dtype=self.dtype,
            device=self.device,
            max_num_batched_tokens=c.max_num_batched_tokens,
            max_model_len=max_len,
            max_num_seqs=c.max_num_seqs,
            graph_shapes=graph_shapes,
            num_speculative_tokens=verified_drafts(c),
        )
        side_bytes += block_bytes if graph_shapes is not None else 0  # the graphs' scratch block
        figures = self.memory_figures = measure_figures(
            self.device, peak, c.reserved_memory_mib, side_bytes, block_bytes
        )
        requested = c.num_kv_blocks
        if requested is None and c.kv_cache_memory_gb is not None:
            requested = max(int((c.kv_cache_memory_gb * 2**30 - side_bytes) // block_bytes), 1)
        useful = c.max_num_seqs * math.ceil(max_len / self.block_size)
        n = plan_kv_pool(figures, c.gpu_memory_utilization, requested, useful)
        log.info("memory plan on %s: %s -> %d KV blocks", self.device, figures.summary(), n)
        return n

    def _num_kv_blocks(self, bytes_per_block: int, max_len: int, side_bytes: int) -> int:
        """CPU: token-space blocks of config.num_kv_blocks, else what kv_cache_memory_gb (or
        DEFAULT_CPU_KV_GB) holds after the window and state spaces (side_bytes)."""
        c = self.config
        if c.num_kv_blocks is not None:
            return c.num_kv_blocks
        budget = (c.kv_cache_memory_gb or DEFAULT_CPU_KV_GB) * 2**30
        useful = c.max_num_seqs * math.ceil(max_len / self.block_size)  # more could never be used
        n = min(int((budget - side_bytes) // bytes_per_block), useful)
        if n < 1:
            raise ValueError(
                f"no room for a single KV block ({bytes_per_block} bytes) in {budget / 2**30:.2f} GiB "
                f"after {side_bytes / 2**30:.2f} GiB of sliding-window blocks and per-sequence state"
            )
        return n

    # -- one step (rank 0) --
    def run(self, sched: SchedulerOutput, while_busy: Callable[[], None] | None = None) -> list[SampledToken]:
        """Forward the scheduled tokens; returns one sampled token per sequence whose chunk
        reached its last token, in scheduled order. while_busy: called (at least once) while the
        device computes a step that samples, every WHILE_BUSY_POLL_S until it is done, instead
        of blocking in the read of the tokens (the engine starts KV loads there)."""
        return self.launch(sched).read(while_busy)

    @torch.inference_mode()
    def launch(self, sched: SchedulerOutput, prev: LaunchedStep | None = None) -> LaunchedStep:
        """Queue the step's forward and sampling on the device and start its tokens' copy to the
        host, without waiting for them. prev: the step launched before, still in flight (the
        overlapped loop): a row whose input is a token prev sampled reads it on the device."""
        step, sampling, holes = self.prepare(sched)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # per thread: the engine loop's thread starts on cuda:0
        feed = feed_from(holes, prev, self.device)
        if self.graphs is not None and self.graphs.fits(step):  # decode and verify steps: every chunk samples
            hidden, last = self.graphs.run(step, feed), torch.cumsum(step.lens, 0) - 1  # [T, hidden], [N]
        else:
            if self.ranks is not None:
                self.ranks.check_alive()
                protocol.send_forward(self.tp, step, fed=feed is not None)
            batch = self._batch(step).to(self.device)
            if feed is not None:
                batch.input_ids[feed[0]] = feed[2][feed[1]]
                if self.ranks is not None:  # the ranks' ids, in flight too: after this write on the device
                    self.tp.broadcast(batch.input_ids)
            hidden, last = self.model.forward(batch, self.kv_cache), batch.logits_indices
        self.last_hidden = hidden if self.keep_hidden else None  # MTP drafts read it (spec_decode/mtp.py)
        if not sampling:
            return LaunchedStep([])
        counts = verify.draft_counts(sched)
        if counts is not None:  # drafts to verify: logits at each of their positions, sampled on the host
            logits = self.model.compute_logits(hidden[verify.logits_rows(last, counts).to(self.device)])
            return LaunchedStep(
                sampling, verify=lambda busy: verify.sample(self.sampler, logits, sampling, counts, busy)
            )
        hidden = hidden[last.to(self.device)] if len(last) < hidden.shape[0] else hidden  # [N, hidden]
        tokens, lp_source = self.sampler.draw(self.model.compute_logits(hidden), sampling)  # logits [N, V]
        return LaunchedStep(sampling, self.sampler.stage(tokens, lp_source, sampling))

    @torch.inference_mode()
    def run_mtp(self, step: StepInputs, prev: torch.Tensor) -> torch.Tensor:
        """The MTP layer over step's tokens, paired with prev [T, H] (V4: [T, N, H]; spec_decode/mtp.py),
        on every rank; returns its output g, the same shape."""
        prev = prev.to(self.dtype).contiguous()
        if self.ranks is not None:
            self.ranks.check_alive()
            protocol.send_forward(self.tp, step, protocol.Command.MTP)
            self.tp.broadcast(prev)
        return self.model.forward_mtp(ForwardBatch.build(step, self.block_size).to(self.device), self.kv_cache, prev)

    def _batch(self, step: StepInputs) -> ForwardBatch:
        rows = self.max_chunk > 1 and all_decode_rows(step, self.max_chunk)  # verify steps: as graphs run them
        return ForwardBatch.build(step, self.block_size, as_decode_rows=rows)

    def prepare(self, sched: SchedulerOutput) -> tuple[StepInputs, list[Sequence], list[tuple[int, Sequence]]]:
        """The step's compact inputs (ForwardBatch.build expands them), the sequences that sample,
        and the holes: (row of input_ids, sequence) where the input is the sequence's in-flight
        token (the overlapped loop; 0 stands in until the device writes it: `launch`)."""
        chunks = sched.scheduled
        seqs = [s.seq for s in chunks]
        width = max(len(s.block_table) for s in seqs)
        input_ids: list[int] = []
        holes: list[tuple[int, Sequence]] = []
        for s in chunks:  # a verify chunk's last num_spec tokens are its drafts
            end = s.start + s.num_tokens - s.num_spec
            input_ids.extend(s.seq.tokens_between(s.start, end))
            if end > s.seq.num_known_tokens:  # a decode row after a step still in flight
                if s.num_tokens != 1 or end != s.seq.num_known_tokens + 1:
                    raise RuntimeError(f"{s.seq!r}: only a decode row's one input may be in flight")
                holes.append((len(input_ids), s.seq))
                input_ids.append(0)
            input_ids.extend(s.seq.spec_token_ids[: s.num_spec])
        step = StepInputs(
            input_ids=torch.tensor(input_ids, dtype=torch.int64),
            lens=torch.tensor([s.num_tokens for s in chunks], dtype=torch.int64),
            starts=torch.tensor([s.start for s in chunks], dtype=torch.int64),
            samples=torch.tensor([s.samples for s in chunks], dtype=torch.bool),
            block_tables=torch.from_numpy(step_tables.block_rows(seqs, width)),
            window_tables=torch.from_numpy(
                step_tables.window_rows(seqs, [s.start for s in chunks], width, self.window_tokens, self.block_size)
            ),
            state_slots=torch.tensor([s.seq.state_slot for s in chunks], dtype=torch.int64),
            state_dst=_state_dst(chunks),
        )
        return step, [s.seq for s in chunks if s.samples], holes

    @torch.inference_mode()
    def copy_records(self, copies: list[tuple[str, int, int]]) -> None:
        """Copy whole blocks (window space) and slots (state space), (space, src, dst) in order:
        prefix checkpoints taken and restored (engine/prefix_checkpoints.py), before a forward;
        every rank the same in its own pool."""
        if copies and self.ranks is not None:
            self.ranks.check_alive()
            protocol.send_copies(self.tp, copies)
        for space, src, dst in copies:
            for name, region in self.kv_cache.regions.items():
                if self.kv_cache.specs[name].space == space:
                    region[:, dst] = region[:, src]

    @torch.inference_mode()
    def on_kv_loaded(self, block_ids: list[int], window_block_ids: list[int], state_slot: int) -> None:
        """KV read from a prefill worker into rank 0's blocks (token, window and state space):
        copy those blocks to every rank."""
        ids = protocol.SpaceIds(
            block_ids, [b for b in window_block_ids if b >= 0], [state_slot] if state_slot >= 0 else []
        )
        if self.ranks is None or not (ids.tokens or ids.window or ids.state):
            return
        self.ranks.check_alive()
        protocol.send_sync_kv(self.tp, ids)
        self._sync_kv(ids)

    def _sync_kv(self, ids: protocol.SpaceIds) -> None:
        for name in sorted(self.kv_cache.regions):
            mine = ids.of(self.kv_cache.specs[name].space)
            if not mine:
                continue
            idx = torch.tensor(mine, dtype=torch.int64, device=self.device)
            region = self.kv_cache.regions[name]  # [L, num_blocks, block_size, dim]
            if self.tp.is_driver:
                self.tp.broadcast(region.index_select(1, idx))  # [L, n, block_size, dim]
            else:
                buf = region.new_empty((region.shape[0], len(mine), *region.shape[2:]))
                self.tp.broadcast(buf)
                region.index_copy_(1, idx, buf)

    # -- ranks 1..N-1 --
    @torch.inference_mode()
    def serve_forever(self) -> None:
        """Run rank 0's steps until it sends STOP."""
        while True:
            msg = protocol.receive(self.tp)
            if msg.command is protocol.Command.STOP:
                return
            if msg.command is protocol.Command.SYNC_KV:
                self._sync_kv(msg.ids)
                continue
            if msg.command is protocol.Command.COPY:
                self.copy_records(msg.copies)
                continue
            if msg.command is protocol.Command.MTP:
                rows = (msg.step.input_ids.numel(), *row_shape(self.model))  # [T, H] (V4: [T, N, H])
                prev = torch.empty(rows, dtype=self.dtype, device=self.device)
                self.tp.broadcast(prev)
                self.run_mtp(msg.step, prev)
                continue
            batch = self._batch(msg.step).to(self.device)
            if msg.fed:  # the input ids with rank 0's in-flight tokens
                self.tp.broadcast(batch.input_ids)
            self.model.forward(batch, self.kv_cache)

    # -- lifecycle --
    def shutdown(self, clean: bool = True) -> None:
        """Rank 0: stop ranks 1..N-1 (STOP, then kill after a grace period) and leave the group.
        Idempotent; a no-op at TP1."""
        ranks, self.ranks = self.ranks, None
        if ranks is None:
            return
        self._finalizer.detach()
        if clean:
            try:
                ranks.check_alive()
                protocol.send_stop(self.tp)
            except Exception:  # a rank already died: kill the rest
                clean = False
        ranks.wait() if clean else ranks.kill()
        self.tp.destroy()


def _state_dst(chunks: list[ScheduledSeq]) -> torch.Tensor | None:
    """Where each chunk's new state record goes, when a verify chunk writes a spare slot."""
    if all(s.state_dst < 0 for s in chunks):
        return None
    return torch.tensor([s.state_dst if s.state_dst >= 0 else s.seq.state_slot for s in chunks], dtype=torch.int64)


def _side_spaces(specs: list[KVRegionSpec], max_num_seqs: int, block_size: int) -> tuple[int | None, int, int]:
    """(window_tokens, window blocks, state slots) of the pool: room for max_num_seqs sequences
    in a step and as many more between steps (a prefill worker's sequences held for decode);
    (None, 0, 0) for a model with neither a sliding-window nor a per-sequence state region."""
    windows = {s.last_tokens for s in specs if s.space == WINDOW}
    window = max(windows) if windows else None
    window_blocks = 2 * max_num_seqs * BlockManager.window_blocks_per_seq(window, block_size) if windows else 0
    state_slots = 2 * max_num_seqs if any(s.space == STATE for s in specs) else 0
    return window, window_blocks, state_slots
