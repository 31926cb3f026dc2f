"""The `pdserve` command: subcommand dispatch, `pdserve health` exit codes, make-tiny-model."""

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

from pdserve.cli import main
from pdserve.health_cli import format_table, health_url

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self):  # noqa: N802 (http.server's name)
        code = self.status if self.path == "/health" else 404
        body = json.dumps({"status": "ok" if code == 200 else "down"}).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def http_server():
    """Start real HTTP servers answering /health with a given status; stop them afterwards."""
    servers = []

    def start(status: int) -> str:
        handler = type("Handler", (_Health,), {"status": status})
        srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
        return f"http://127.0.0.1:{srv.server_address[1]}"

    yield start
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def _closed_port_url() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.slow
def test_help_lists_every_subcommand_without_loading_torch():
    code = "import sys; from pdserve.cli import main\ntry: main(['--help'])\nexcept SystemExit: pass\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    for sub in ("launch", "serve", "bench", "bench-engine", "make-tiny-model", "health"):
        assert sub in out
    assert out.strip().endswith("False")


@pytest.mark.slow
def test_python_dash_m_runs_the_same_command():
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve", "health", "--timeout", "-1"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "--timeout must be > 0" in proc.stderr


@pytest.mark.parametrize(
    "given, url",
    [
        ("127.0.0.1:8000", "http://127.0.0.1:8000/health"),
        ("http://h:30000/", "http://h:30000/health"),
        ("https://h/health", "https://h/health"),
    ],
)
def test_health_url(given, url):
    assert health_url(given) == url


def test_health_exit_codes(http_server, capsys):
    up, down, gone = http_server(200), http_server(503), _closed_port_url()
    assert main(["health", "--url", up, "--url", up.replace("http://", "")]) == 0
    out = capsys.readouterr().out
    assert out.count(" ok ") == 2 and f"{up}/health" in out
    assert main(["health", "--url", up, "--url", down]) == 1
    assert "DOWN    503" in capsys.readouterr().out
    assert main(["health", "--url", up, "--url", gone, "--timeout", "1"]) == 1
    assert "unreachable" in capsys.readouterr().out
    with pytest.raises(SystemExit) as err:
        main(["health", "--no-such-flag"])
    assert err.value.code == 2


def test_format_table_aligns_columns():
    assert format_table(["a", "bb"], [["xxx", "y"], ["z", "w"]]).splitlines() == ["a    bb", "xxx  y", "z    w"]


def test_make_tiny_model(tmp_path, capsys):
    assert main(["make-tiny-model", str(tmp_path / "m"), "--arch", "deepseek_v32", "--seed", "1"]) == 0
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v32"
    assert "wrote a tiny deepseek_v32 checkpoint (seed 1)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as err:
        main(["make-tiny-model", str(tmp_path / "x"), "--arch", "llama"])
    assert err.value.code == 2
    # a larger random model: config keys set, bf16 weights of the new shapes
    big = [
        "make-tiny-model",
        str(tmp_path / "b"),
        "--set",
        "hidden_size=192",
        "--set",
        "n_routed_experts=4",
        "--dtype",
        "bfloat16",
    ]
    assert main(big) == 0
    assert "wrote a random deepseek_v3 checkpoint (seed 0, bfloat16, 2 config keys set)" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["n_routed_experts"], cfg["dtype"]) == (192, 4, "bfloat16")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "b" / "model.safetensors"), "pt") as f:
        embed = f.get_tensor("model.embed_tokens.weight")
        assert embed.dtype == torch.bfloat16 and embed.shape[1] == 192
        assert (
            "model.layers.1.mlp.experts.3.up_proj.weight" in f.keys()
            and "model.layers.1.mlp.experts.4.up_proj.weight" not in f.keys()
        )
    assert main(["make-tiny-model", str(tmp_path / "c"), "--set", "hidden_sise=192"]) == 2
    assert "unknown config keys for deepseek_v3: hidden_sise" in capsys.readouterr().err


def test_launch_with_an_unknown_config_is_a_usage_error(capsys):
    assert main(["launch", "--config", "no-such-config"]) == 2
    assert "config 'no-such-config' not found" in capsys.readouterr().err


def test_serve_parses_its_own_flags(capsys):
    with pytest.raises(SystemExit) as err:
        main(["serve", "--help"])
    assert err.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: pdserve serve")
    for flag in ("--role", "--port", "--model", "--peer", "--prefill", "--decode", "--cluster-secret"):
        assert flag in out


def test_bench_gets_all_of_its_argv(capsys):
    with pytest.raises(SystemExit) as err:
        main(["bench", "--help"])
    assert err.value.code == 0
    assert "--base-url" in capsys.readouterr().out
    assert main(["bench", "--concurrency", "1,8"]) == 2  # reaches bench's own checks: 2 levels, 3 default prompt counts
    assert "--concurrency has 2 levels but --num-prompts has 3" in capsys.readouterr().err


def test_bench_engine_gets_all_of_its_argv(capsys):
    with pytest.raises(SystemExit) as err:
        main(["bench-engine", "--help"])
    assert err.value.code == 0
    assert "--num-layers" in capsys.readouterr().out
    assert (
        main(["bench-engine", "--dtype", "fp8"]) == 2
    )  # its own check (default model v4-flash), before any model is built
    assert "for DeepSeek-V4 use --dtype fp4" in capsys.readouterr().err


@pytest.mark.slow
def test_console_script_runs_cli_main():
    # the repo is installed editable (README, .ci/run): the `pdserve` script is pdserve.cli:main
    (script,) = entry_points(group="console_scripts", name="pdserve")
    assert script.value == "pdserve.cli:main"
    exe = Path(sys.executable).parent / "pdserve"
    proc = subprocess.run([str(exe), "health", "--timeout", "0"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--timeout must be > 0" in proc.stderr


def test_tiny_models_are_served_under_their_arch():
    """Without served_model_name, `pdserve launch` (default config: tiny:deepseek_v3) serves
    tiny-deepseek-v3, and `--model tiny:deepseek_v4` serves tiny-deepseek-v4, not the default's name."""
    from pdserve.config import default_served_name, load_config

    assert load_config().served_model_name is None
    assert default_served_name("tiny:deepseek_v3") == "tiny-deepseek-v3"
    assert default_served_name("tiny:deepseek_v4") == "tiny-deepseek-v4"
    assert default_served_name("/models/DeepSeek-V4-Flash") is None
