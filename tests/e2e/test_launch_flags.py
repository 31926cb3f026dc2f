"""First contact under a real `pdserve launch` (issue 29, item 5): a config holding only one
router key merges with the defaults, the serve flags (`--api-key`, ports, `--served-model-name`,
worker sizes) override it, and `pdserve health` tells a wrong key from a server that is down."""

import os
import subprocess

import openai
import pytest
import yaml

from tests.helpers.launch import free_ports, pdserve, start_launch, stop_group, wait_up

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]
KEY = "sk-launch-flags"


def _health(url: str, env: dict) -> subprocess.CompletedProcess:
    proc = pdserve("health", "--url", url, "--timeout", "5", "--status", os.devnull, env=env,
                   stdout=subprocess.PIPE, text=True)  # fmt: skip
    out, _ = proc.communicate(timeout=30)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out)


def test_launch_flags_over_a_partial_config(tmp_path):
    ports = free_ports(3)
    config = tmp_path / "partial.yaml"
    config.write_text(yaml.safe_dump({"router": {"health_interval": 0.5}}))  # no model, no workers: the defaults'
    flags = ["--api-key", KEY, "--port", str(ports[0]), "--prefill-port", str(ports[1]), "--decode-port", str(ports[2]),
             "--served-model-name", "tiny", "--num-kv-blocks", "64", "--max-num-seqs", "4",
             "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    proc, out = start_launch(config, tmp_path, None, *flags)
    try:
        wait_up(proc, out)
        router = f"http://127.0.0.1:{ports[0]}"
        no_key = {"PDSERVE_API_KEY": "", "OPENAI_API_KEY": ""}
        missing = _health(router, no_key)
        assert missing.returncode == 1 and "401: wrong or missing API key" in missing.stdout, missing.stdout
        assert "DOWN" not in missing.stdout
        assert _health(router, {**no_key, "OPENAI_API_KEY": KEY}).returncode == 0

        client = openai.OpenAI(api_key=KEY, base_url=router + "/v1", max_retries=0)
        r = client.completions.create(model="tiny", prompt="hi", max_tokens=3, temperature=0)
        assert r.choices[0].finish_reason in ("length", "stop")
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(api_key="wrong", base_url=router + "/v1", max_retries=0).models.list()
        workers = _health(f"http://127.0.0.1:{ports[1]}", no_key)  # workers need no key
        assert workers.returncode == 0, workers.stdout
        served = yaml.safe_load((tmp_path / "logs" / "prefill-0.json").read_text())
        assert served["worker"]["num_kv_blocks"] == 64 and served["worker"]["max_num_seqs"] == 4
    finally:
        stop_group(proc)
