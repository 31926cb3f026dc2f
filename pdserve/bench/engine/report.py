"""The bench-engine report as text: a header (device, date, model, ceilings), one table row per
(batch, context) with step time, tok/s, the floor and the ratio, the time by kernel class, and
the naive baseline."""

from __future__ import annotations

from pdserve.bench.engine.profile import ORDER


def format_header(report: dict) -> str:
    env, s, roof = report["environment"], report["settings"], report["ceilings"]
    return "\n".join([
        f"pdserve bench-engine: {s['model']}, {s['num_layers']} layers ({describe_layers(s['layer_kinds'])}), "
        f"{weights(s)}, KV {s['kv_cache_dtype']}, load_format {s['load_format']}",
        f"{env['device']}, {env['date']}, torch {env['torch']}, triton {env['triton']}; measured ceilings: "
        f"copy {roof['copy_bytes_per_s'] / 1e12:.4g} TB/s (read + write), matmul {roof['matmul_flops_per_s'] / 1e12:.4g} TFLOP/s",
        "",
        "| batch | context | step ms | tok/s | floor ms (bytes / flops) | x floor | " + " | ".join(ORDER) + " |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in ORDER) + " |",
    ])  # fmt: skip


def weights(s: dict) -> str:
    if s.get("quantization") == "fp4":
        return f"FP4 e2m1 routed experts + FP8 e4m3 projections (kept), {s['dtype']} activations"
    if s.get("quantization") == "fp8":
        return f"FP8 e4m3 weights (block-scaled, kept FP8), {s['dtype']} activations"
    return f"{s['dtype']} weights"


def format_baseline(report: dict) -> str:
    lines = []
    for row in report["rows"]:
        if "baseline" in row:
            b = row["baseline"]["step_ms"]
            lines.append(
                f"naive baseline (B={row['batch']}, context {row['context']}, torch reference kernels): "
                f"{b:.2f} ms a step, {b / row['step_ms']:.2f}x the step above"
            )
    return "\n".join(lines)


def format_row(row: dict) -> str:
    head = f"| {row['batch']} | {row['context']} | "
    if "error" in row:
        return head + f"failed: {row['error'][:200]} |"
    share = row.get("profile", {}).get("share", {})
    classes = " | ".join(f"{100 * share[c]:.0f}%" if c in share else "-" for c in ORDER)
    return head + (
        f"{row['step_ms']:.2f} | {row['tok_s']:.1f} | {row['floor_ms']:.3f} ({row['bytes_ms']:.3f} / {row['flops_ms']:.3f}) "
        f"| {row['ratio']:.1f}x | {classes} |"
    )


def describe_layers(kinds: dict) -> str:
    """'1 sliding, 4 CSA, 3 HCA; 1 hash-routed MoE' or '1 dense, 4 MoE'."""
    if "layer_types" in kinds:
        t, m = kinds["layer_types"], kinds["mlp_layer_types"]
        names = (
            ("sliding_attention", "sliding"),
            ("compressed_sparse_attention", "CSA"),
            ("heavily_compressed_attention", "HCA"),
        )
        parts = [f"{t.count(k)} {short}" for k, short in names if t.count(k)]
        return ", ".join(parts) + f"; {m.count('hash_moe')} hash-routed MoE"
    dense = kinds.get("first_k_dense_replace", 0)
    return f"{dense} dense MLP, the rest MoE"
