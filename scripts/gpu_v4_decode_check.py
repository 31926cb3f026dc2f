"""DeepSeek-V4 decode against prefill on a GPU, at V4-Flash's attention widths and long contexts.

    python scripts/gpu_v4_decode_check.py [--contexts 4096,8192,16384,32768] [--steps 16]
        [--variants bfloat16:auto:graphs,bfloat16:auto:eager,bfloat16:fp8:graphs,float32:auto:graphs]
        [--device cuda] [--out FILE_OR_DIR] [--budget-s 500]
    python scripts/gpu_v4_decode_check.py --device cpu --tiny --contexts 300 --steps 4   # smoke test

The model: V4-Flash's config (pdserve.bench.engine.models.V4_FLASH: hidden 4096, vocab 129,280,
64 heads of 512 with 64 rope dims, q_lora 1024, 8 output groups of rank 1024, a 128-token window,
CSA rate 4 with its indexer of 64 x 128 and index_topk 512, HCA rate 128, 4 residual streams) cut
to 4 layers (sliding, CSA, HCA, CSA; the first hash-routed) and 8 routed experts 512 wide (the
experts are not what is checked; float32's parity tiles make wide ones slow), with random weights
made in memory (`load_format="dummy"`: N(0, 1 / fan_in) matrices, activations keep their scale).
`--tiny` takes the tiny V4's widths instead (window 8, rates 4 and 16, index_topk 16), for a CPU.

For each variant (dtype : KV cache dtype : graphs or eager; one engine each, prefix caching off)
and each context L: a random prompt of L - 5 tokens, so that the decoded tokens cross CSA groups
and, L a multiple of 128, an HCA boundary; N = --steps greedy tokens with their top-5 logprobs
(token 0 comes from the prompt's prefill, tokens 1.. from N - 1 decode steps: CUDA graph replays
unless eager); then the prompt + generated[:j] for every j < N prefilled afresh in one batch
(max_tokens 1), so each decoded position is computed again by the prefill path (chunks of up to
max_num_batched_tokens; a prefill step that would run as a decode step voids the case). Per
position: both greedy tokens, the decoded token's logprob in both (when the prefill's top-5 has
it) and every top-5 token both have.

Prints progress, then one table: tokens equal, the largest |logprob difference| of the decoded
token and over the shared top-5, graph replays / decode steps, the time of each case. Writes the
rows as JSON to --out (a file, or v4_decode_check.json in a folder) after every case. Exit
status 1 if a variant raised, a case is void, or a float32 case has a different token or a top-5
difference above --fp32-tol (bf16 and fp8 are reported only). A case is skipped when its time,
predicted from the same engine's previous case, would end past --budget-s. The default run on an
H100 is estimated at 4-6 minutes (~1M prefill tokens a variant; float32 takes the parity tiles).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pdserve import LLM, SamplingParams
from pdserve.bench.engine.models import V4_FLASH, write_config
from pdserve.model.deepseek_v4.config import CSA, HCA, SLIDING
from pdserve.outputs import Logprob
from pdserve.tiny_model import tiny_v4_config

LAYERS = [SLIDING, CSA, HCA, CSA]
MLP_LAYERS = ["hash_moe", "moe", "moe", "moe"]
BACK = 5  # the prompt stops this many tokens short of the context: decode crosses L itself
TOP = 5
VARIANTS = "bfloat16:auto:graphs,bfloat16:auto:eager,bfloat16:fp8:graphs,float32:auto:graphs"


@dataclass(frozen=True)
class Variant:
    dtype: str  # the engine's dtype
    kv: str  # kv_cache_dtype: auto (= dtype) or fp8
    eager: bool  # enforce_eager: decode steps run eagerly, not as graph replays

    @classmethod
    def parse(cls, spec: str) -> Variant:
        dtype, kv, mode = spec.split(":")
        if mode not in ("graphs", "eager"):
            raise ValueError(f"variant {spec!r}: the mode must be graphs or eager")
        return cls(dtype, kv, mode == "eager")

    @property
    def name(self) -> str:
        return f"{self.dtype}:{self.kv}:{'eager' if self.eager else 'graphs'}"


@dataclass
class Row:
    context: int
    dtype: str
    kv: str
    eager: bool
    steps: int
    equal: int  # positions whose greedy token the prefill chose too
    first_diff: int | None  # the first position that differs
    d_token: float  # max |logprob of the decoded token, decode - prefill|
    d_top5: float  # max over every top-5 token both have
    missing: int  # positions whose decoded token is not in the prefill's top-5
    decode_steps: int  # steps of the decode run that ran as decode steps (N - 1 expected)
    replays: int  # of those, CUDA graph replays (0: eager, or a CPU)
    void: int  # steps of the prefill batch that ran as decode steps (0 expected)
    seconds: float  # the decode and the N prefills


class PathCounter:
    """Counts the engine's steps that run as decode steps (every chunk one token that samples:
    the decode path, a graph replay where one fits) and its graph replays."""

    def __init__(self, llm: LLM) -> None:
        self.decode_steps = self.replays = 0
        runner = llm.engine.runner
        run, graphs = runner.run, runner.graphs

        def counted_run(sched, *args, **kwargs):
            self.decode_steps += bool(sched.scheduled) and all(s.num_tokens == 1 and s.samples for s in sched.scheduled)
            return run(sched, *args, **kwargs)

        runner.run = counted_run
        if graphs is not None:
            replay = graphs.run

            def counted_replay(step, feed=None):
                self.replays += 1
                return replay(step, feed)

            graphs.run = counted_replay

    def take(self) -> tuple[int, int]:
        """(decode steps, replays) since the last take."""
        out = (self.decode_steps, self.replays)
        self.decode_steps = self.replays = 0
        return out


def model_config(tiny: bool) -> dict:
    """config.json of the 4-layer model (module docstring)."""
    if tiny:
        # the tiny V4 (hidden 128, window 8, rates 4 / 16); top-16 of a 300-token context's 75 entries
        d = tiny_v4_config(512) | {"index_topk": 16}
    else:
        d = dict(V4_FLASH, moe_intermediate_size=512)
        for key in ("compress_ratios", "num_hash_layers"):
            d.pop(key)
    d.update(num_hidden_layers=len(LAYERS), layer_types=LAYERS, mlp_layer_types=MLP_LAYERS)
    d.update(n_routed_experts=8, num_nextn_predict_layers=0)
    return d


def prompt(context: int, vocab: int, seed: int) -> list[int]:
    """context - BACK random ids, the special ones (0, 1: BOS, EOS) left out."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + context)
    return torch.randint(2, vocab, (context - BACK,), generator=gen).tolist()


def make_llm(folder: Path, v: Variant, args: argparse.Namespace, max_len: int) -> LLM:
    # max_num_seqs: the N prefills run as one batch; graphs for batch 1 only (the decode's)
    return LLM(
        str(folder), device=args.device, dtype=v.dtype, load_format="dummy", skip_tokenizer_init=True,
        enable_prefix_caching=False, max_model_len=max_len, max_num_seqs=args.steps, cuda_graph_max_bs=1,
        kv_cache_dtype=v.kv, enforce_eager=v.eager,
    )  # fmt: skip


def run_case(llm: LLM, paths: PathCounter, ids: list[int], steps: int) -> tuple[list, list, list, dict]:
    """(decoded tokens, their logprobs, the prefill's (token, logprobs) at each of their positions,
    the steps that ran as decode steps: Row's decode_steps, replays, void)."""
    greedy = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True, logprobs=TOP)
    out = llm.generate(prompt_token_ids=[ids], sampling_params=greedy)[0].outputs[0]
    decode_steps, replays = paths.take()
    tokens, logprobs = list(out.token_ids), out.logprobs
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=TOP)
    prefixes = [ids + tokens[:j] for j in range(steps)]
    again = [o.outputs[0] for o in llm.generate(prompt_token_ids=prefixes, sampling_params=one)]
    counts = {"decode_steps": decode_steps, "replays": replays, "void": paths.take()[0]}
    return tokens, logprobs, [(o.token_ids[0], o.logprobs[0]) for o in again], counts


def compare(tokens: list[int], decoded: list[dict[int, Logprob]], prefilled: list[tuple[int, dict]]) -> dict:
    """Row fields of one case: per position, decode's token and logprobs against the prefill's."""
    equal, first, d_token, d_top5, missing = 0, None, 0.0, 0.0, 0
    for j, (tok, dec, (pre_tok, pre)) in enumerate(zip(tokens, decoded, prefilled)):
        equal += pre_tok == tok
        first = j if first is None and pre_tok != tok else first
        if tok in pre:
            d_token = max(d_token, abs(dec[tok].logprob - pre[tok].logprob))
        else:
            missing += 1
        for t in dec.keys() & pre.keys():
            d_top5 = max(d_top5, abs(dec[t].logprob - pre[t].logprob))
    return {"equal": equal, "first_diff": first, "d_token": d_token, "d_top5": d_top5, "missing": missing}


def release(device: str) -> None:
    """Give a dropped engine's memory back before the next one is built."""
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def run_variant(
    folder: Path, v: Variant, args: argparse.Namespace, vocab: int, deadline: float, rows: list[Row]
) -> None:
    """Every context's case on one engine of variant v (built for the first case that starts),
    appended to rows as it ends (an exception keeps those before it)."""
    llm, paths, last = None, None, None
    max_len = max(args.contexts) + args.steps + 64
    try:
        for context in args.contexts:
            # the previous case's time scaled by context (prefill tokens; the indexer grows faster: 1.2x)
            guess = 1.2 * last.seconds * context / last.context if last else 0.0
            if time.monotonic() + guess > deadline:
                print(f"{v.name} L={context}: skipped, it would end past --budget-s", flush=True)
                continue
            if llm is None:
                start = time.perf_counter()
                llm = make_llm(folder, v, args, max_len)
                paths = PathCounter(llm)
                print(f"{v.name}: engine ready in {time.perf_counter() - start:.1f} s", flush=True)
            start = time.perf_counter()
            tokens, decoded, prefilled, counts = run_case(llm, paths, prompt(context, vocab, args.seed), args.steps)
            fields = compare(tokens, decoded, prefilled) | counts
            r = last = Row(context, v.dtype, v.kv, v.eager, args.steps, **fields, seconds=time.perf_counter() - start)
            rows.append(r)
            write(rows, args.out)  # a run stopped at its time limit keeps the cases done
            print(f"{v.name} L={context}: equal {r.equal}/{r.steps}, d_token {r.d_token:.2e}, d_top5 {r.d_top5:.2e}, "
                  f"replays {r.replays}/{r.decode_steps}, void {r.void}, {r.seconds:.1f} s", flush=True)  # fmt: skip
    finally:
        if llm is not None:
            llm.engine.shutdown()
        llm = paths = None
        release(args.device)


def table(rows: list[Row]) -> str:
    head = f"{'context':>8} {'dtype':>9} {'kv':>5} {'graphs':>6} {'steps':>5} {'equal':>6} "
    lines = [head + f"{'d_token':>9} {'d_top5':>9} {'time_s':>7}"]
    for r in sorted(rows, key=lambda r: (r.context, r.dtype, r.kv, r.eager)):
        graphs = "eager" if r.eager else f"{r.replays}/{r.decode_steps}"  # replays / decode steps
        graphs += "!" if r.void else ""  # a prefill step ran as a decode step: the case is void
        lines.append(
            f"{r.context:>8} {r.dtype:>9} {r.kv:>5} {graphs:>6} {r.steps:>5} {f'{r.equal}/{r.steps}':>6} "
            f"{r.d_token:>9.2e} {r.d_top5:>9.2e} {r.seconds:>7.1f}"
        )
    return "\n".join(lines)


def write(rows: list[Row], out: str | None) -> None:
    if out is None:
        return
    path = Path(out) / "v4_decode_check.json" if Path(out).is_dir() else Path(out)
    path.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")


def failed(rows: list[Row], tol: float) -> list[Row]:
    """Void cases, and float32 cases that differ: a token, or a top-5 logprob past tol."""
    return [r for r in rows if r.void or r.dtype == "float32" and (r.equal < r.steps or r.d_top5 > tol)]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="the tiny V4's widths (a CPU smoke test)")
    p.add_argument("--contexts", default="4096,8192,16384,32768")
    p.add_argument("--steps", type=int, default=16, help="tokens decoded, each position prefilled again")
    p.add_argument("--variants", default=VARIANTS, help="dtype:kv:graphs|eager, comma-separated")
    p.add_argument("--seed", type=int, default=0, help="of the prompts (the weights: the engine's seed 0)")
    p.add_argument("--out", default=None, help="JSON rows: a file, or a folder for v4_decode_check.json")
    p.add_argument("--budget-s", type=float, default=500.0, help="start no case predicted to end later")
    p.add_argument("--fp32-tol", type=float, default=1e-3)
    args = p.parse_args()
    args.contexts = [int(c) for c in args.contexts.split(",")]
    args.variants = [Variant.parse(s) for s in args.variants.split(",")]
    if args.steps < 1 or min(args.contexts) <= BACK:
        p.error(f"--steps must be >= 1 and every context > {BACK}")
    return args


def main() -> int:
    args = parse_args()
    deadline = time.monotonic() + args.budget_s
    config = model_config(args.tiny)
    rows: list[Row] = []
    errors: list[str] = []
    with tempfile.TemporaryDirectory() as root:
        folder = write_config(config, Path(root) / "v4-decode-check")
        for v in args.variants:
            try:
                run_variant(folder, v, args, config["vocab_size"], deadline, rows)
            except Exception:  # one variant's failure (an OOM, a kernel error) leaves the others to run
                traceback.print_exc()
                errors.append(v.name)
    print(table(rows), flush=True)
    print(f"total {args.budget_s - (deadline - time.monotonic()):.0f} s", flush=True)
    bad = failed(rows, args.fp32_tol)
    print(f"errors in: {', '.join(errors)}" if errors else "no errors", flush=True)
    print(f"FAILED: {len(bad)} case(s) void or float32 differing" if bad else "float32 cases equal", flush=True)
    return 1 if bad or errors else 0


if __name__ == "__main__":
    sys.exit(main())
