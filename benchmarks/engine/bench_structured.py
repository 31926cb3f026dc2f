"""Structured outputs' cost in a decode step: engine decode steps (ModelRunner.run, CUDA graphs where
the runner uses them) of B sequences with no grammar against the same steps with every row under a
JSON schema, and the two parts of the masked step alone: the host filling the rows' masks
(llguidance, its thread pool) and the device applying them.

    python -m benchmarks.engine.bench_structured [--model v3.2] [--num-layers 4] [--batch 1,16,64] [--json out.json]
    python -m benchmarks.engine.bench_structured --host-only --batch 1,16     # the host's mask fill, no model

The tokenizer is made here with DeepSeek's vocabulary size (129280): a byte-level BPE vocabulary of
the most frequent pieces of the Python standard library's sources (no tokenizer can be downloaded
where this runs), so a grammar state that allows most of the vocabulary (inside a JSON string)
costs what it costs with a real one. Rows alternate between a schema that is mostly free text and
one of nested objects, enums and integers. Times are medians of host clocks around synchronized
steps (ms).
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import torch

VOCAB = 129280
SCHEMAS = [
    {
        "type": "object",
        "properties": {"title": {"type": "string"}, "body": {"type": "string"}},
        "required": ["title", "body"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 10**9},
            "kind": {"enum": ["a", "b", "c"]},
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"n": {"type": "integer"}, "ok": {"type": "boolean"}, "tag": {"type": "string"}},
                    "required": ["n", "ok", "tag"],
                    "additionalProperties": False,
                },
            },
        },
        "required": ["id", "kind", "items"],
        "additionalProperties": False,
    },
]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte as a printable character (what ByteLevel BPE stores)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


def synthetic_tokenizer_json(vocab_size: int = VOCAB) -> str:
    """A byte-level BPE tokenizer.json of `vocab_size` tokens: BOS, EOS, the 256 bytes, then the
    standard library's most frequent pieces (GPT-style pre-tokenization)."""
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE

    counts: collections.Counter[str] = collections.Counter()
    piece = re.compile(r"'s|'t| ?[A-Za-z]+| ?\d{1,3}| ?[^\sA-Za-z\d]+|\s+")
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            counts.update(piece.findall(path.read_text(encoding="utf-8", errors="ignore")))
        except OSError:
            continue
    b2u = _bytes_to_unicode()
    vocab: dict[str, int] = {}
    for b in range(256):
        vocab[b2u[b]] = len(vocab)
    for text, _ in counts.most_common():
        if len(vocab) >= vocab_size - 2:
            break
        vocab.setdefault("".join(b2u[b] for b in text.encode()), len(vocab))
    n = len(vocab)
    while len(vocab) < vocab_size - 2:  # a small stdlib: numbered filler pieces
        vocab.setdefault(b2u[ord(" ")] + f"x{len(vocab) - n}", len(vocab))
    tok = Tokenizer(BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<bos>", special=True), AddedToken("<eos>", special=True)])
    return tok.to_str()


def compiler(vocab_size: int):
    from pdserve.structured.compiler import GrammarCompiler

    return GrammarCompiler(synthetic_tokenizer_json(vocab_size), vocab_size, [vocab_size - 1])


def matchers(comp, n: int) -> list:
    from pdserve.sampling_params import StructuredOutputsParams
    from pdserve.structured.matcher import RequestMatcher

    specs = [StructuredOutputsParams(json=s) for s in SCHEMAS]
    return [RequestMatcher(comp.compile(specs[i % len(specs)]), specs[i % len(specs)]) for i in range(n)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def walk(masks, ms: list, steps: int, gen: torch.Generator, fill_ms: list[float]) -> None:
    """Fill, pick a random allowed token per row (host), advance: `steps` grammar steps, timing the fill."""
    host_words = masks.words
    for _ in range(steps):
        t0 = time.perf_counter()
        dev = masks.fill(ms)
        _sync(masks.device)
        fill_ms.append(1e3 * (time.perf_counter() - t0))
        bits = ((dev.cpu()[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).view(len(ms), host_words * 32)
        for i, m in enumerate(ms):
            allowed = bits[i, : masks.vocab_size].nonzero().flatten()
            m.advance(int(allowed[torch.randint(len(allowed), (1,), generator=gen)]))


def host_only(args) -> dict:
    from pdserve.structured.bitmask import TokenMasks

    comp = compiler(VOCAB)
    rows = {}
    for b in args.batch:
        masks = TokenMasks(VOCAB, torch.device("cpu"))
        fill_ms: list[float] = []
        walk(masks, matchers(comp, b), args.steps, torch.Generator().manual_seed(b), fill_ms)
        rows[b] = {
            "fill_ms_median": statistics.median(fill_ms),
            "fill_ms_p90": sorted(fill_ms)[int(0.9 * len(fill_ms))],
        }
        print(
            f"B={b:3d}  host mask fill: median {rows[b]['fill_ms_median']:.3f} ms, p90 {rows[b]['fill_ms_p90']:.3f} ms"
        )
    return {"host_only": rows, "vocab": VOCAB}


def engine_steps(args) -> dict:
    from pdserve.bench.engine.decode import DecodeBench
    from pdserve.bench.engine.models import bench_config, write_config
    from pdserve.engine.config import EngineConfig

    model_json = bench_config(args.model, args.num_layers)
    vocab = model_json["vocab_size"]
    B, C = max(args.batch), args.context
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-structured-") as folder:
        config = EngineConfig(
            model=str(write_config(model_json, Path(folder))), device=args.device, dtype="bfloat16",
            load_format="dummy", kv_block_size=64, num_kv_blocks=B * (-(-(C + 2 * args.steps + 64) // 64)) + 8,
            max_num_seqs=B, max_model_len=C + 2 * args.steps + 64, seed=0,
        )  # fmt: skip
        bench = DecodeBench(config)
    comp = compiler(vocab)
    out = {"model": args.model, "num_layers": args.num_layers, "context": C, "graphs": bench.runner.graphs is not None}
    out["device"] = torch.cuda.get_device_name(bench.device) if bench.device.type == "cuda" else "cpu"
    rows = {}
    for b in args.batch:
        seqs = bench.make_batch(b, C)
        plain = _steps(bench, seqs, args.steps)
        for seq, m in zip(seqs, matchers(comp, b)):
            seq.grammar = m
        masked = _steps(bench, seqs, args.steps)
        fill_ms, apply_ms = _parts(bench, seqs)
        bench.free(seqs)
        row = {
            "step_ms": statistics.median(plain), "masked_step_ms": statistics.median(masked),
            "host_fill_ms": statistics.median(fill_ms), "device_apply_ms": statistics.median(apply_ms),
        }  # fmt: skip
        row["overhead"] = row["masked_step_ms"] / row["step_ms"] - 1
        rows[b] = row
        print(
            f"B={b:3d}  step {row['step_ms']:.3f} ms  masked {row['masked_step_ms']:.3f} ms  "
            f"(+{100 * row['overhead']:.1f}%)  host fill {row['host_fill_ms']:.3f} ms  apply {row['device_apply_ms']:.3f} ms",
            flush=True,
        )
    out["rows"] = rows
    return out


def _steps(bench, seqs, n: int) -> list[float]:
    """n decode steps (the first two warm-up) advancing each row's grammar by its token."""
    times = []
    for i in range(n + 2):
        before = [len(s.output_token_ids) for s in seqs]
        t = bench.step(seqs)  # appends each sampled token
        for s, k in zip(seqs, before):
            if s.grammar is not None:
                assert s.grammar.advance(s.output_token_ids[k]), s.grammar.error
        if i >= 2:
            times.append(1e3 * t)
    return times


@torch.inference_mode()  # the sampler's buffers were made in the runner's inference mode
def _parts(bench, seqs, n: int = 20) -> tuple[list[float], list[float]]:
    """The masked step's two parts alone: the host fill (copy included) and the device apply."""
    masks = bench.runner.sampler.masks
    x = torch.randn(len(seqs), bench.vocab, device=bench.device)
    fill, apply = [], []
    for _ in range(n):
        _sync(bench.device)
        t0 = time.perf_counter()
        dev = masks.fill([s.grammar for s in seqs])
        _sync(bench.device)
        t1 = time.perf_counter()
        masks.apply(x, dev)
        _sync(bench.device)
        fill.append(1e3 * (t1 - t0))
        apply.append(1e3 * (time.perf_counter() - t1))
    return fill, apply


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--model", default="v3.2", help="pdserve bench-engine's model names (v3.2, v4-flash, tiny-v3.2, tiny-v4)"
    )
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--batch", type=lambda s: [int(b) for b in s.split(",")], default=[1, 16, 64])
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--host-only", action="store_true", help="time the host's mask fill alone (no model)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    report = host_only(args) if args.host_only else engine_steps(args)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
