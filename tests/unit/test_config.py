"""Cluster config: shipped files validate, names resolve, and bad configs fail with clear messages."""

import copy

import pytest
import yaml

from pdserve.config import CONFIG_DIR, ClusterConfig, ConfigError, find_config, load_config, parse_config

PD = {
    "model": "tiny:deepseek_v3",
    "prefill": [{"port": 30000, "numa_node": 0}],
    "decode": [{"port": 30001, "numa_node": 0}],
}


def _error(data) -> str:
    with pytest.raises(ConfigError) as err:
        parse_config(data, "test.yaml")
    return str(err.value)


def _with(path: str, value):
    """PD with one field replaced; path like 'prefill.0.port'."""
    data = copy.deepcopy(PD)
    *parents, last = path.split(".")
    node = data
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node.setdefault(key, {})
    node[int(last) if isinstance(node, list) else last] = value
    return data


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_validates(path):
    cfg = load_config(str(path))
    assert cfg.named_workers()
    assert load_config(path.stem) == cfg  # also found by name


def test_shipped_configs_are_the_expected_ones():
    names = {p.stem for p in CONFIG_DIR.glob("*.yaml")}
    assert {"tiny-cpu", "8x-rtx-pro-6000-pd", "colocated-tp4"} <= names


def test_default_is_tiny_cpu_pd_on_the_standard_ports():
    cfg = load_config()
    assert cfg.model == "tiny:deepseek_v3" and cfg.router.port == 8000
    assert [(n, w.port, w.device) for n, w in cfg.named_workers()] == [
        ("prefill-0", 30000, "cpu"),
        ("decode-0", 30001, "cpu"),
    ]


def test_reference_topology():
    cfg = load_config("8x-rtx-pro-6000-pd")
    (p,), (d,) = cfg.prefill, cfg.decode
    assert (p.gpus, p.tp_size, p.numa_node, p.port) == ([0, 1, 2, 3], 4, 0, 30000)
    assert (d.gpus, d.tp_size, d.numa_node, d.port) == ([4, 5, 6, 7], 4, 1, 30001)
    assert cfg.transfer.backend == "nixl" and "UCX_TLS" in cfg.transfer.env()


def test_defaults_fill_in():
    cfg = parse_config(PD)
    assert cfg.router.host == "127.0.0.1" and cfg.router.prefill_policy == "auto"
    w = cfg.prefill[0]
    assert (w.host, w.device, w.tp_size, w.kv_block_size, w.lease_seconds) == ("127.0.0.1", "cpu", 1, 64, 60.0)
    assert cfg.transfer.backend == "nixl" and cfg.cluster_secret is None


def test_find_config_names_the_shipped_ones():
    with pytest.raises(ConfigError, match=r"config 'nope' not found .*'tiny-cpu'"):
        find_config("nope")


def test_yaml_and_shape_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_config(str(bad))
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="expected a mapping at the top level, got list"):
        load_config(str(bad))
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump(PD))
    assert isinstance(load_config(str(good)), ClusterConfig)


@pytest.mark.parametrize(
    "data, message",
    [
        (_with("prefill.0.bogus", 1), "prefill.0.bogus: Extra inputs are not permitted"),
        (_with("router.prot", 1), "router.prot: Extra inputs are not permitted"),
        (_with("decode.0.port", 30000), "port 30000 is used by both prefill-0 and decode-0"),
        (_with("prefill.0.port", 8000), "port 8000 is used by both router and prefill-0"),
        (_with("prefill.0.port", 70000), "prefill.0.port: Input should be less than or equal to 65535"),
        (_with("decode", []), "PD needs both prefill and decode workers"),
        ({"model": "m"}, "no workers"),
        (_with("model", "tiny:llama"), "unknown tiny model 'tiny:llama'"),
        (_with("model", " "), "model must be a checkpoint folder"),
        (_with("prefill.0.device", "cuda"), "a cuda worker needs gpus"),
        (_with("prefill.0.gpus", [0]), "a cpu worker takes no gpus"),
        (_with("prefill.0.numa_node", "auto"), "numa_node 'auto' follows the worker's GPUs"),
        (_with("prefill.0.numa_node", -1), "numa_node must be >= 0"),
        (_with("prefill.0.numa_node", "zero"), "prefill.0.numa_node"),
        (_with("prefill.0.cpus", "0-x"), "bad cpulist '0-x'"),
        (_with("prefill.0.cpus", ","), "cpus must name at least one CPU"),
        (_with("transfer.backend", "tcp"), "transfer.backend: Input should be 'nixl'"),
        (
            _with("transfer.backend", "fake"),
            "transfer.backend: Input should be 'nixl'",
        ),  # the test fake is not for clusters
        (
            _with("transfer.kv_load_failure_policy", "retry"),
            "transfer.kv_load_failure_policy: Input should be 'fail' or 'recompute'",
        ),
        (_with("router.breaker_failures", 0), "router.breaker_failures: Input should be greater than or equal to 1"),
        (_with("transfer.ucx", {"TLS": "tcp"}), "UCX_* environment variables only; not: ['TLS']"),
        (_with("router.prefill_policy", "random"), "router.prefill_policy: Input should be 'auto'"),
        (_with("prefill.0.kv_block_size", 0), "prefill.0.kv_block_size: Input should be greater than or equal to 1"),
        ({"prefill": [{"port": 1}], "decode": [{"port": 2}]}, "model: Field required"),
    ],
)
def test_clear_validation_errors(data, message):
    text = _error(data)
    assert text.startswith("test.yaml is not a valid pdserve config:") or "test.yaml:" in text
    assert message in text, text


def test_cuda_worker_tp_must_match_gpus():
    data = _with("prefill.0", {"port": 30000, "device": "cuda", "gpus": [0, 1], "tp_size": 1})
    assert "tp_size (1) must equal the number of gpus ([0, 1])" in _error(data)
    assert "distinct non-negative" in _error(
        _with("prefill.0", {"port": 30000, "device": "cuda", "gpus": [0, 0], "tp_size": 2})
    )
    ok = parse_config(_with("prefill.0", {"port": 30000, "device": "cuda", "gpus": [2], "numa_node": "auto"}))
    assert ok.prefill[0].numa_node == "auto"


def test_cpus_needs_a_node():
    assert "cpus narrows a NUMA node: set numa_node too" in _error(_with("prefill.0", {"port": 30000, "cpus": "0"}))
    assert parse_config(_with("prefill.0.cpus", "0")).prefill[0].cpus == "0"


def test_one_gpu_pd_and_its_colocated_baseline():
    """pd-1gpu: two processes sharing GPU 0 (each sees it as its only GPU), NIXL between them;
    colocated-1gpu: the same worker settings in one engine on the same GPU."""
    from pdserve.launch import plan

    pd, col = load_config("pd-1gpu"), load_config("colocated-1gpu")
    specs = {s.role: s for s in plan(pd, "/m")}
    assert specs["prefill"].env["CUDA_VISIBLE_DEVICES"] == specs["decode"].env["CUDA_VISIBLE_DEVICES"] == "0"
    assert specs["prefill"].port != specs["decode"].port and pd.transfer.backend == "nixl"
    (p,), (d,), (c,) = pd.prefill, pd.decode, col.colocated
    keys = ("device", "dtype", "kv_block_size", "num_kv_blocks", "max_num_seqs", "max_model_len")
    assert [getattr(c, k) for k in keys] == [getattr(p, k) for k in keys] == [getattr(d, k) for k in keys]
    assert c.max_num_batched_tokens == p.max_num_batched_tokens
    assert (
        p.load_format == d.load_format == c.load_format == "dummy"
    )  # benchmarks/pd/pd_gpu_mid_model.py writes no weights


def test_router_processes_reach_the_router_from_the_yaml():
    from pdserve.launch import plan

    cfg = parse_config(_with("router.api_server_count", 4))
    assert plan(cfg, "/m")[-1].config.router.api_server_count == 4
    assert parse_config(_with("router", {})).router.api_server_count == 1
    assert "api_server_count" in _error(_with("router.api_server_count", 0))


def test_a_cached_tiny_model_of_another_format_is_made_anew(tmp_path, monkeypatch):
    """A tiny folder an older pdserve wrote (no stamp, or another format) is replaced on next use."""
    import json

    from pdserve.config import TINY_FORMAT, TINY_STAMP, resolve_model

    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    old = tmp_path / "tiny-deepseek_v4-seed0"
    old.mkdir()
    (old / "config.json").write_text("{}")
    (old / "stale").write_text("from an older pdserve")
    path = resolve_model("tiny:deepseek_v4")
    assert path == str(old) and not (old / "stale").exists()
    assert json.loads((old / TINY_STAMP).read_text()) == {"format": TINY_FORMAT, "arch": "deepseek_v4", "seed": 0}
    assert json.loads((old / "config.json").read_text())["model_type"] == "deepseek_v4"
    (old / "kept").write_text("same format: used as it is")
    assert resolve_model("tiny:deepseek_v4") == str(old) and (old / "kept").exists()
    assert not list(tmp_path.glob("*.tmp-*")) and not list(tmp_path.glob("*.old-*"))
