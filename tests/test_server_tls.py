"""HTTPS (`--ssl-certfile` / `--ssl-keyfile`): the flags are checked, and the SDK talks to the
server over TLS with a certificate it trusts."""

from __future__ import annotations

import shutil
import ssl
import subprocess
from pathlib import Path

import httpx
import openai
import pytest

from gptoss_serve import cli
from gptoss_serve.config import ServerConfig
from gptoss_serve.server.app import create_app
from gptoss_serve.server.store import ResponseStore
from server_helpers import REASONING_THEN_FINAL, ScriptedEngine, harmony_tokens, running_server


def test_the_flags_go_together_and_name_missing_files(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    assert cli.tls_options(None, None) == {}
    with pytest.raises(cli.UsageError, match="go together"):
        cli.tls_options(cert, None)
    with pytest.raises(cli.UsageError, match="--ssl-certfile: no file"):
        cli.tls_options(cert, key)
    cert.write_text("x")
    key.write_text("y")
    assert cli.tls_options(cert, key) == {"ssl_certfile": str(cert), "ssl_keyfile": str(key)}
    args = cli.build_parser().parse_args(
        ["serve", "--model", "demo", "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
    )
    assert (args.ssl_certfile, args.ssl_keyfile) == (cert, key)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
def test_the_sdk_over_https(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    engine = ScriptedEngine()
    engine.queue(harmony_tokens(REASONING_THEN_FINAL))
    app = create_app(engine, ResponseStore(":memory:"), ServerConfig())
    with running_server(app, **cli.tls_options(cert, key)) as base_url:
        assert base_url.startswith("https://")
        with httpx.Client(verify=ssl.create_default_context(cafile=cert)) as http:
            sdk = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                                http_client=http)  # fmt: skip
            response = sdk.responses.create(model="demo", input="Hi", max_output_tokens=64)
            assert response.output_text == "Hello there, friend! 👋"
        with pytest.raises(httpx.HTTPError):  # plain HTTP to the TLS port
            httpx.get(base_url.replace("https://", "http://") + "/health", timeout=5)
