"""bench/serve_soak.py against the demo model on loopback, briefly: every scenario's requests
end without a 5xx or a broken stream, the grammars hold, and the server is idle afterwards."""

from __future__ import annotations

import json
from pathlib import Path

from bench_scripts import load_bench_script

from gptoss_serve.config import ServerConfig
from gptoss_serve.engine.cpu_engine import CpuEngine
from gptoss_serve.model import load_model
from gptoss_serve.server.app import create_app
from gptoss_serve.server.store import ResponseStore
from server_helpers import running_server


def test_a_short_soak_of_the_demo_server(demo_dir: Path, tmp_path: Path) -> None:
    engine = CpuEngine(load_model(demo_dir), "demo")
    app = create_app(engine, ResponseStore(str(tmp_path / "store.sqlite3")), ServerConfig())
    out = tmp_path / "soak.json"
    with running_server(app) as url:
        # A compaction's summary runs to 2,304 tokens on the demo's random weights, ~50 s on
        # a CPU core: left out here (tests/test_server_compaction.py has compaction).
        argv = ["--base-url", url, "--seconds", "4", "--workers", "3", "--prompt-words", "60",
                "--skip", "compaction", "--out", str(out)]  # fmt: skip
        status = load_bench_script("serve_soak").main(argv)
    result = json.loads(out.read_text())
    assert status == 0 and result["problems"] == []
    assert result["model"] == "demo" and result["requests"] > 0
    assert result["prefix_reuse"]["n4"]["choices"] == 4
    assert result["after"]["gptoss_requests_running"] == 0
    assert not any(code.endswith(" 500") for code in result["codes"])
