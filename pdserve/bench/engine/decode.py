"""Decode steps of B sequences whose context is already in the KV cache, run as the engine runs
them: `ModelRunner.run` (ForwardBatch built on the host, model forward, logits, sampling) on one
ScheduledSeq a sequence, blocks allocated by the engine's BlockManager.

The context is not prefilled: every region of the pool is filled with random records once
(a 4K prefill per sequence would cost more than the measurement), and each sequence gets C
random prompt tokens marked as computed plus one sampled token to decode from. Greedy sampling.
"""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from pdserve.bench.engine.ceilings import sync
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.request import Request
from pdserve.engine.scheduler import ScheduledSeq, SchedulerOutput
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True, detokenize=False)


class DecodeBench:
    def __init__(self, config: EngineConfig) -> None:
        self.runner = ModelRunner(config)
        self.device = self.runner.device
        r = self.runner
        self.blocks = BlockManager(
            r.num_kv_blocks,
            config.kv_block_size,
            window_tokens=r.window_tokens,
            num_window_blocks=r.num_window_blocks,
            num_state_slots=r.num_state_slots,
        )  # as LLMEngine builds it
        self.vocab = self.runner.model.config.vocab_size
        kv = self.runner.kv_cache
        self.kv_itemsize = kv.dtype.itemsize  # values records
        latent = kv.specs.get("latent")
        window = kv.specs.get("window")  # V4: its window and entry records share one format
        byte_spec = latent if latent is not None else window
        self.kv_record_bytes = byte_spec.dim if byte_spec is not None and byte_spec.byte_record else None  # FP8 records
        self.gen = torch.Generator().manual_seed(config.seed)
        fill_kv(self.runner.kv_cache, config.seed, rope_dims=self.runner.model.config.qk_rope_head_dim)

    def make_batch(self, batch: int, context: int) -> list[Sequence]:
        """`batch` sequences with `context` tokens in the cache and one to decode next; a failure
        part way frees what was allocated."""
        seqs = []
        for i in range(batch):
            ids = torch.randint(self.vocab, (context + 1,), generator=self.gen).tolist()
            seq = Sequence(Request(request_id=f"bench-{i}", prompt_token_ids=ids[:-1], params=GREEDY))
            seq.append_token(ids[-1])
            # the blocks its prefill would hold: tokens, window blocks of the last positions, state slot
            self.blocks.allocate(seq, context, step_end=context)
            seq.num_computed_tokens = context
            self.blocks.trim_window(seq)
            seq.status = SequenceStatus.RUNNING
            seqs.append(seq)
        return seqs

    def free(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.blocks.free(seq)

    def step(self, seqs: list[Sequence]) -> float:
        """One engine decode step: every sequence computes its last token and samples the next.
        Blocks as the scheduler grants them (before) and trims them (after); returns the seconds
        of `ModelRunner.run` alone (host clock, the device synchronized before and after)."""
        for seq in seqs:
            self.blocks.allocate(seq, seq.num_tokens, seq.num_computed_tokens + 1)
        sync(self.device)
        t0 = time.perf_counter()
        sampled = self.runner.run(SchedulerOutput(scheduled=[ScheduledSeq.of(s, 1) for s in seqs]))
        sync(self.device)
        seconds = time.perf_counter() - t0
        for seq, token in zip(seqs, sampled):
            seq.num_computed_tokens += 1
            seq.append_token(token.token_id)
            self.blocks.trim_window(seq)
        return seconds

    def timed_steps(self, seqs: list[Sequence], n: int) -> list[float]:
        return [self.step(seqs) for _ in range(n)]

    @contextmanager
    def reference_kernels(self):
        """The naive baseline: the torch reference kernels, eager (a CUDA-graph replay would run
        the kernels captured at start, whatever the backend says now)."""
        from pdserve.model import ops

        graphs, self.runner.graphs = self.runner.graphs, None
        ops.set_backend("torch")
        try:
            yield
        finally:
            ops.set_backend(None)
            self.runner.graphs = graphs

    def experts_touched(self, seqs: list[Sequence]) -> dict[int, int]:
        """Run one step; MoE layer -> distinct routed experts the batch used in it."""
        with _routers_recorded(self.runner.model) as seen:
            self.step(seqs)
        return {layer: len(ids) for layer, ids in seen.items()}


@torch.no_grad()
def fill_kv(kv_cache, seed: int, rope_dims: int = 64) -> None:
    """Random records in every region of the pool (the context the step reads): N(0, 1) values,
    and for FP8 byte records random finite e4m3 values with a fixed scale and N(0, 1) bf16 rope
    (the last `rope_dims` values of a record)."""
    for name, t in kv_cache.regions.items():
        g = torch.Generator(device=t.device).manual_seed(seed)
        record = kv_cache.specs[name].record
        if t.dtype != torch.uint8:
            t.normal_(generator=g)
        elif record == "fp8_ds_v4":
            for layer in range(t.shape[0]):  # one layer at a time: the pages of one layer are contiguous
                _fill_fp8_v4_pages(t[layer], rope_dims, g)
        else:
            _fill_fp8_records(t.view(-1, t.shape[-1]), g)


def _random_e4m3(shape: tuple[int, ...], g: torch.Generator, device) -> torch.Tensor:
    vals = torch.randint(0, 0x7F, shape, generator=g, device=device, dtype=torch.uint8)  # no NaN (0x7F)
    return vals | (torch.randint(0, 2, shape, generator=g, device=device, dtype=torch.uint8) << 7)


def _fill_fp8_v4_pages(pages: torch.Tensor, rope: int, g: torch.Generator) -> None:
    """pages [blocks, P, R] uint8 in kernels/kv_fp8.py's fp8_ds_v4 page layout (P records' values,
    then their scales): e4m3 values with scale 2^-9 (ue8m0 118), N(0, 1) bf16 rope, zero padding."""
    from pdserve_kernels.kv_fp8 import V4Record

    R = pages.shape[-1]
    rec = next(V4Record(rope + nope, rope) for nope in range(16, 8 * R, 16) if V4Record(rope + nope, rope).bytes == R)
    values = pages.new_empty(pages.shape[0], pages.shape[1], rec.value_bytes)
    values[..., : rec.nope] = _random_e4m3((*values.shape[:2], rec.nope), g, pages.device)
    rope_values = torch.randn(*values.shape[:2], rope, generator=g, device=pages.device).to(torch.bfloat16)
    values[..., rec.nope :] = rope_values.view(torch.uint8)
    scales = torch.zeros(*values.shape[:2], rec.scale_bytes, dtype=torch.uint8, device=pages.device)
    scales[..., : rec.groups] = 127 - 9
    flat = pages.view(pages.shape[0], -1)  # each page: its P records' values, then their scales
    P = pages.shape[1]
    flat[:, : P * rec.value_bytes] = values.view(pages.shape[0], -1)
    flat[:, P * rec.value_bytes :] = scales.view(pages.shape[0], -1)


def _fill_fp8_records(rows: torch.Tensor, g: torch.Generator) -> None:
    """rows [N, R] uint8 in kernels/kv_fp8.py's layout; R = d_v + 4 d_v / 128 + 2 tail gives d_v
    for the tail widths DeepSeek uses (64)."""
    from pdserve_kernels.kv_fp8 import GROUP, record_bytes

    R, tail = rows.shape[1], 64
    d_v = next(d for d in range(GROUP, R, GROUP) if record_bytes(d, tail) == R)
    G = d_v // GROUP
    rows[:, :d_v] = _random_e4m3((rows.shape[0], d_v), g, rows.device)
    rows[:, d_v : d_v + 4 * G] = torch.full((rows.shape[0], G), 1 / 448, device=rows.device).view(torch.uint8)
    rope = torch.randn(rows.shape[0], tail, generator=g, device=rows.device).to(torch.bfloat16)
    rows[:, d_v + 4 * G :] = rope.view(torch.uint8)


@contextmanager
def _routers_recorded(model: torch.nn.Module):
    """Record the MoE routers' choices (modules named `...layers.N.mlp.gate` returning (weights,
    ids): V3's Gate, V4's Router; V4's Router is also called through `route` when its GEMM is
    joined with the shared expert's); yields layer -> set of expert ids seen."""
    seen: dict[int, set[int]] = {}
    handles, patched = [], []
    for name, module in model.named_modules():
        if name.endswith("mlp.gate"):
            layer = int(name.split("layers.")[1].split(".")[0])

            def record(out, layer=layer):
                seen.setdefault(layer, set()).update(out[1].flatten().tolist())
                return out

            if hasattr(module, "route"):  # V4: forward calls route, and so does the joined path
                route = module.route
                module.route = lambda *a, route=route, record=record, **k: record(route(*a, **k))
                patched.append(module)
            else:

                def hook(_module, _inputs, out, record=record) -> None:
                    record(out)

                handles.append(module.register_forward_hook(hook))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()
        for module in patched:
            del module.route  # the class's method again
