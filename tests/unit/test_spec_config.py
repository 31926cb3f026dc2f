"""speculative_config: validation (vLLM's fields; unknown methods and fields are clear errors),
serve's flag and the cluster YAML key, the n-gram lookup, the start-up refusals (a V4 k past its
window; a prefill worker), and the counters on a worker's /metrics."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.spec_decode.config import SpeculativeConfig
from pdserve.engine.spec_decode.ngram import lookup
from pdserve.tiny_model import make_tiny_model


def test_vllm_fields_and_defaults():
    c = SpeculativeConfig.model_validate({"method": "ngram", "num_speculative_tokens": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_max=4)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    c = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=2, prompt_lookup_max=4)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 4)


@pytest.mark.parametrize(
    "bad, words",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"}, "draft_model"),
        ({"method": "ngram"}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, "exceed"),
        ({"method": "mtp", "num_speculative_tokens": 9}, "num_speculative_tokens"),
    ],
)
def test_bad_configs_are_clear_errors(bad, words):
    with pytest.raises(ValidationError, match=words):
        SpeculativeConfig.model_validate(bad)


def test_ngram_lookup_takes_the_longest_then_latest_match():
    #         0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 2, 3, 8, 7, 1, 2, 3]
    assert lookup(tokens, 1, 3, 2) == [9, 2]  # [1, 2, 3] at 0..2 is the longest match
    assert lookup(tokens, 1, 2, 2) == [8, 7]  # [2, 3]: the latest one, at 4..5
    assert lookup(tokens, 4, 5, 2) == []  # no 4-gram recurs
    assert lookup([5, 5, 5], 1, 2, 3) == [5]  # overlapping match, one token left after it
    assert lookup([4], 1, 3, 3) == []


def _config(path, **kw) -> EngineConfig:
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    return EngineConfig(
        model=str(path), kv_block_size=4, num_kv_blocks=32, skip_tokenizer_init=True, speculative_config=spec, **kw
    )


def test_v4_refuses_a_verify_chunk_longer_than_its_window(tmp_path):
    """The tiny V4's window (8) keeps 7 positions: k = 7 would make chunks of 8."""
    path = make_tiny_model(tmp_path / "v4", "deepseek_v4")
    with pytest.raises(ValueError, match="more than the model's sliding window keeps"):
        LLMEngine(_config(path).model_copy(update={"speculative_config": SpeculativeConfig(
            method="ngram", num_speculative_tokens=7)}))  # fmt: skip


def test_the_counters_reach_the_workers_metrics():
    from prometheus_client import generate_latest

    from pdserve.engine.spec_decode.metrics import SpecDecodeStats
    from pdserve.worker.metrics import WorkerMetrics

    stats, metrics = SpecDecodeStats(3), WorkerMetrics()
    stats.observe(3, 2)
    stats.observe(2, 0)
    metrics.sync_spec_decode(stats)
    stats.observe(3, 3)
    metrics.sync_spec_decode(stats)  # only what is new since the last sync is added
    text = generate_latest(metrics.registry).decode()
    assert "pdserve_spec_decode_num_drafts_total 3.0" in text
    assert "pdserve_spec_decode_num_draft_tokens_total 8.0" in text
    assert "pdserve_spec_decode_num_accepted_tokens_total 5.0" in text
    for pos, n in enumerate([2, 2, 1]):
        assert f'pdserve_spec_decode_num_accepted_tokens_per_pos_total{{position="{pos}"}} {n}.0' in text
    assert stats.mean_accepted_length == pytest.approx(1 + 5 / 3)


def _serve(*argv: str):
    import argparse

    from pdserve.serve import add_serve_args, config_from_args

    p = argparse.ArgumentParser()
    add_serve_args(p)
    return config_from_args(p.parse_args(list(argv)))


def test_serve_takes_the_flag_as_json_and_refuses_it_on_prefill_workers(tmp_path):
    spec = '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'
    cfg = _serve("--role", "colocated", "--model", "m", "--speculative-config", spec)
    assert cfg.worker.speculative_config == SpeculativeConfig(
        method="ngram", num_speculative_tokens=2, prompt_lookup_max=3
    )
    assert (
        cfg.worker.engine_config(str(make_tiny_model(tmp_path, "deepseek_v3"))).speculative_config
        == cfg.worker.speculative_config
    )
    with pytest.raises(ValueError, match="on a prefill worker takes method 'mtp' only"):
        _serve("--role", "prefill", "--model", "m", "--speculative-config", spec)
    decode = _serve("--role", "decode", "--model", "m", "--peer", "http://p:1", "--speculative-config", spec)
    assert decode.worker.speculative_config.num_speculative_tokens == 2
    with pytest.raises(ValueError, match="speculative_config.*Extra inputs|extra"):
        _serve("--role", "colocated", "--model", "m", "--speculative-config", '{"method": "ngram", "k": 2}')
    with pytest.raises(SystemExit):  # argparse: not a JSON object
        _serve("--role", "colocated", "--model", "m", "--speculative-config", "ngram")


def test_a_cluster_refuses_it_on_prefill_workers_only():
    from pdserve.config import ClusterConfig, ConfigError, parse_config

    spec = {"method": "ngram", "num_speculative_tokens": 2}
    ok = parse_config({"model": "tiny:deepseek_v3", "colocated": [{"port": 30002, "speculative_config": spec}]}, "t")
    assert isinstance(ok, ClusterConfig) and ok.colocated[0].speculative_config.num_speculative_tokens == 2
    pd = {
        "model": "tiny:deepseek_v3",
        "prefill": [{"port": 30000}],
        "decode": [{"port": 30001, "speculative_config": spec}],
    }
    assert parse_config(pd, "t").decode[0].speculative_config.num_speculative_tokens == 2
    pd["prefill"][0]["speculative_config"] = spec
    with pytest.raises(ConfigError, match="prefill-0: speculative_config on a prefill worker takes method 'mtp' only"):
        parse_config(pd, "t")


def test_the_memory_profile_runs_a_verify_step(tmp_path):
    """The start-up profile's verify step (chunks of k + 1 tokens, logits at every position) runs
    with the engine's own model and pool; off CUDA it measures nothing."""
    from pdserve.engine.memory import profile_peak

    runner = LLMEngine(_config(make_tiny_model(tmp_path / "v3", "deepseek_v3"))).runner
    specs = runner.model.kv_cache_specs("auto")
    kw = dict(block_size=4, dtype=runner.dtype, device=runner.device, max_num_batched_tokens=24, max_model_len=64)
    assert profile_peak(runner.model, specs, **kw, max_num_seqs=8, graph_shapes=None, num_speculative_tokens=2) == 0
