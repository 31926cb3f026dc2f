"""The sm_120 tile configs, compiled for sm_120 (no GPU needed: Triton compiles ahead of time for
a target with its bundled ptxas) by scripts/check_sm120_configs.py: every kernel's shared memory,
as the compiler allocated it, fits the RTX PRO 6000's 101,376 bytes per block, and the default
configs do not spill registers. Run in a subprocess: the other kernel tests import triton in
interpreter mode, which cannot compile."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.timeout(600)
# V4's decode- and chunk-step metadata kernels take rope's cos / sin with libdevice's exact cosf / sinf (the
# values torch gives): for angles past ~1e5 rad (long contexts) it reduces the argument through a
# 32-byte array on the stack, the one stack use allowed below
EXACT_TRIG = {"_window_rope", "_rate_entries", "_chunk_window_rope", "_chunk_rate_entries"}


@pytest.mark.slow
def test_sm120_configs_compile_within_shared_memory(tmp_path):
    triton = pytest.importorskip("triton")
    if not os.path.exists(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")):
        pytest.skip("this Triton has no bundled ptxas")
    out = tmp_path / "sm120.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *sys.path])  # pdserve_kernels as this process finds it
    res = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "check_sm120_configs.py"), "--json", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=540,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert {r["family"] for r in rows} >= {
        "mla",
        "indexer",
        "moe",
        "moe_fp8",
        "moe_fp4",
        "moe_fp4_frag",
        "moe_fp4_mx8",
        "fp8_gemm",
        "fp8_gemv",
        "hc",
        "v4_chunk_step",
        "block_copy",
        "kv_checksum",
    }
    # DeepSeek-V4-Flash's attention (D = d_v = 512, sinks) in bf16, over fp8_ds_v4 pages and at
    # the float32 parity tile
    v4 = {r["case"].split()[0] for r in rows if r["kernel"] == "_mla_split_kernel" and "V4-Flash" in r["case"]}
    assert v4 == {"bf16", "fp8_v4", "fp32"}, v4
    # the MX8 FP4 MoE's GEMMs run on sm_120's block-scaled MMA (e4m3 x e4m3, ue8m0 scales), not on
    # a bf16 mma.sync after an upcast
    mx8 = [r for r in rows if r["family"] == "moe_fp4_mx8" and r["kernel"] in ("_w13_mx8_kernel", "_w2_mx8_kernel")]
    assert mx8 and all(any("kind::mxf8f6f4.block_scale" in m for m in r["mma"]) for r in mx8), mx8
    assert all(not any(".bf16" in m for m in r["mma"]) for r in mx8), mx8
    for r in rows:
        assert r["fits"] and r["shared_total"] <= 101376, r
        if r["kernel"] in EXACT_TRIG:  # libdevice's large-angle reduction: its 32-byte array, no spill
            assert r["stack"] <= 32 and r["local"] == 0, r
        elif r["family"] != "moe_fp4_dot_scaled":  # the engine's configs: no local-memory spills
            assert r["stack"] == 0 and r["local"] == 0, r
