"""Memory planned at start (issue 29, item 2): the pool's arithmetic on numbers (it fits; it does
not, and the message gives the numbers and the largest pool; two workers sharing one GPU each get
their share), the profile forwards on CPU on the tiny V3 and V4 (peak measured only on CUDA), and
a pool that cannot fit refused by `pdserve serve` before it binds its port. The GPU's figures in
that last test are given (this machine has none); the profile, the plan and the refusal are real."""

import pytest

from pdserve.config import resolve_model
from pdserve.engine import model_runner
from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.memory import GiB, MemoryFigures, MiB, PoolDoesNotFit, plan_kv_pool, profile_peak

pytestmark = pytest.mark.timeout(120)
H100 = 80 * GiB


def figures(**kw) -> MemoryFigures:
    base = dict(
        total=H100,
        used_by_others=0,
        weights=10 * GiB,
        peak_activation=4 * GiB,
        non_torch=GiB // 2,
        reserve=GiB // 2,
        side_bytes=0,
        block_bytes=64 * MiB,
    )
    return MemoryFigures(**(base | kw))


def test_a_requested_pool_that_fits_is_the_pool():
    # 0.5 x 80 = 40 GiB - 15 GiB of needs = 25 GiB = 400 blocks of 64 MiB
    assert plan_kv_pool(figures(), 0.5, 400, useful=10**6) == 400


def test_unset_the_pool_is_the_largest_that_fits_capped_by_what_could_be_used():
    assert plan_kv_pool(figures(), 0.5, None, useful=10**6) == 400
    assert plan_kv_pool(figures(), 0.5, None, useful=123) == 123
    assert plan_kv_pool(figures(side_bytes=GiB), 0.5, None, useful=10**6) == 384  # window/state spaces first


def test_a_pool_that_does_not_fit_names_the_numbers_and_the_largest_pool():
    with pytest.raises(PoolDoesNotFit) as err:
        plan_kv_pool(figures(), 0.5, 401, useful=10**6)
    text = str(err.value)
    for part in (
        "num_kv_blocks 401 (64.00 MiB a block) does not fit",
        "gpu_memory_utilization 0.5 of 80.00 GiB allows 40.00 GiB",
        "weights 10.00 GiB",
        "peak activations 4.00 GiB",
        "CUDA context and libraries 0.50 GiB",
        "reserve 0.50 GiB",
        "the largest pool that fits: num_kv_blocks 400",
    ):
        assert part in text, (part, text)
    assert isinstance(err.value, ValueError)  # what `pdserve serve` reports as a start-up error


def test_no_room_for_a_single_block():
    with pytest.raises(PoolDoesNotFit, match="(?s)a single KV block .*no pool fits"):
        plan_kv_pool(figures(weights=36 * GiB), 0.5, None, useful=10)


def test_two_workers_on_one_gpu_each_get_their_share():
    # the first planned alone; the second sees what the first holds (its share, at most) as others'
    first = plan_kv_pool(figures(), 0.45, None, useful=10**6)
    assert first == (int(0.45 * H100) - 15 * GiB) // (64 * MiB) == 336
    held = 15 * GiB + first * 64 * MiB
    second = plan_kv_pool(figures(used_by_others=held), 0.45, None, useful=10**6)
    assert second == first  # the same share, the same pool: the first's memory is not the second's
    assert held + 15 * GiB + second * 64 * MiB <= 0.9 * H100
    # a second at 0.9 is held to what the first leaves free, and says so when it asks for more
    assert plan_kv_pool(figures(used_by_others=held), 0.9, None, useful=10**6) == (H100 - held - 15 * GiB) // (64 * MiB)
    with pytest.raises(PoolDoesNotFit, match="(?s)other processes hold 36.00 GiB .*they, not the share, are the limit"):
        plan_kv_pool(figures(used_by_others=held), 0.9, 700, useful=10**6)


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v4"])
def test_the_profile_forwards_run_on_cpu(arch):
    """The engine's own model and pool specs through the profile path (prefill chunks filling the
    step's budget, the one-token decodes, a captured batch size): no error, no peak off CUDA."""
    config = EngineConfig(
        model=resolve_model(f"tiny:{arch}"), num_kv_blocks=64, kv_block_size=16, max_num_seqs=4, cpu_threads=1
    )
    runner = LLMEngine(config).runner
    specs = runner.model.kv_cache_specs(config.kv_cache_dtype)
    peak = profile_peak(
        runner.model,
        specs,
        block_size=16,
        dtype=runner.dtype,
        device=runner.device,
        max_num_batched_tokens=40,
        max_model_len=24,  # 40 tokens: chunks of 24 and 16
        max_num_seqs=4,
        graph_shapes=[(2, 1), (2, 3)],
    )
    assert peak == 0


def test_serve_refuses_a_pool_that_cannot_fit(monkeypatch, capsys):
    """`pdserve serve` plans as on a GPU (the figures given: 2 GiB, 1.5 GiB of weights): the real
    profile on the tiny model, the plan, and the refusal with its numbers, exit 2, no port bound."""
    given: list[tuple[int, int]] = []

    def on_a_small_gpu(device, peak, reserve_mib, side_bytes, block_bytes):
        given.append((peak, block_bytes))
        return MemoryFigures(2 * GiB, 0, 3 * GiB // 2, peak, 0, reserve_mib * MiB, side_bytes, block_bytes)

    monkeypatch.setattr(model_runner, "plans_memory", lambda device: True)
    monkeypatch.setattr(model_runner, "measure_figures", on_a_small_gpu)
    from pdserve import serve

    argv = ["--role", "colocated", "--model", "tiny:deepseek_v3", "--port", "1"]  # port 1: never bound
    argv += ["--kv-block-size", "16", "--max-num-batched-tokens", "32", "--max-num-seqs", "4"]
    code = serve.main([*argv, "--num-kv-blocks", "10000000", "--gpu-memory-utilization", "0.5"])
    err = capsys.readouterr().err
    assert code == 2, err
    (peak, block_bytes), largest = given[0], (GiB - 3 * GiB // 2) // given[0][1]
    assert peak == 0 and block_bytes > 0
    assert "num_kv_blocks 10000000" in err and "gpu_memory_utilization 0.5 of 2.00 GiB allows 1.00 GiB" in err
    assert "weights 1.50 GiB" in err and "no pool fits" in err and largest < 1
    # at 0.9 a pool fits (the largest is named when asked for more)
    code = serve.main([*argv, "--num-kv-blocks", "10000000", "--gpu-memory-utilization", "0.9"])
    err = capsys.readouterr().err
    largest = (int(0.9 * 2 * GiB) - 3 * GiB // 2) // block_bytes  # colocated on cpu: no arenas
    assert code == 2 and f"the largest pool that fits: num_kv_blocks {largest}" in err, err


def test_launch_sets_every_workers_share():
    import argparse

    from pdserve.launch.flags import add_launch_flags, apply_flags, load_cluster

    parser = argparse.ArgumentParser()
    add_launch_flags(parser)
    cfg = apply_flags(load_cluster("tiny-cpu"), parser.parse_args(["--gpu-memory-utilization", "0.45"]))
    assert [w.gpu_memory_utilization for w in cfg.prefill + cfg.decode] == [0.45, 0.45]
    assert cfg.prefill[0].engine_config(resolve_model("tiny:deepseek_v3")).gpu_memory_utilization == 0.45
    with pytest.raises(Exception, match="gpu_memory_utilization"):
        apply_flags(cfg, parser.parse_args(["--gpu-memory-utilization", "1.5"]))


def test_the_engine_takes_the_planned_pool(monkeypatch):
    """Planned as on a GPU (figures given: weights that leave 0.75 of 1 GiB room for 100 blocks):
    unset num_kv_blocks, the pool is the largest that fits."""
    seen: list[MemoryFigures] = []

    def on_a_small_gpu(device, peak, reserve_mib, side_bytes, block_bytes):
        weights = int(0.75 * GiB) - side_bytes - 100 * block_bytes
        seen.append(MemoryFigures(GiB, 0, weights, peak, 0, reserve_mib * MiB, side_bytes, block_bytes))
        return seen[-1]

    monkeypatch.setattr(model_runner, "plans_memory", lambda device: True)
    monkeypatch.setattr(model_runner, "measure_figures", on_a_small_gpu)
    config = EngineConfig(
        model=resolve_model("tiny:deepseek_v3"),
        kv_block_size=16,
        max_num_seqs=2,
        max_num_batched_tokens=32,
        gpu_memory_utilization=0.75,
    )
    engine = LLMEngine(config)
    assert engine.num_kv_blocks == 100 and engine.runner.memory_figures is seen[0]
    assert engine.max_model_len == 100 * 16  # capped by the pool, as before
