import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from gptoss_serve import cli
from gptoss_serve.checkpoint.demo import DEMO_VERSION, demo_checkpoint_dir
from gptoss_serve.model import load_model


@pytest.fixture(scope="session")
def demo_cache(demo_dir: Path) -> Path:
    return demo_dir.parents[1]  # <cache>/gptoss-serve/demo-v1


@pytest.fixture()
def use_demo_cache(demo_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(demo_cache))
    return demo_cache


def test_demo_checkpoint_is_written_once_with_the_real_vocabulary(demo_cache: Path) -> None:
    path = demo_checkpoint_dir(demo_cache)
    assert path == demo_cache / "gptoss-serve" / f"demo-v{DEMO_VERSION}"
    weights = path / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert demo_checkpoint_dir(demo_cache) == path and weights.stat().st_mtime_ns == stamp
    model = load_model(path)
    assert model.config.vocab_size == 201088
    assert not list(path.parent.glob(".demo-*"))  # no staging leftovers


def test_make_checkpoint_then_logits(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    out = tmp_path / "ck"
    argv = ["make-checkpoint", str(out), "--layers", "2", "--vocab", "300", "--shards", "2"]
    assert cli.main(argv) == 0
    assert (out / "model.safetensors.index.json").exists()
    ids_file = tmp_path / "ids.txt"
    ids_file.write_text("5, 17 250\n3\n")
    npy = tmp_path / "logits.npy"
    argv = ["logits", "--model", str(out), "--prompt-ids", f"@{ids_file}", "--out", str(npy)]
    assert cli.main(argv) == 0
    logits = np.load(npy)
    assert logits.shape == (4, 300) and logits.dtype == np.float32
    model = load_model(out)
    expected = model(torch.tensor([5, 17, 250, 3]), model.new_cache())
    np.testing.assert_array_equal(logits, expected.numpy())
    # bfloat16 logits come back as float32 too.
    argv = ["logits", "--model", str(out), "--prompt-ids", "1,2", "--dtype", "bfloat16"]
    assert cli.main([*argv, "--out", str(npy)]) == 0
    assert np.load(npy).dtype == np.float32


def test_generate_on_demo(use_demo_cache: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["generate", "--model", "demo", "--prompt", "Hi", "--max-tokens", "8"]
    assert cli.main([*argv, "--temperature", "0", "--reasoning-effort", "low"]) == 0
    err = capsys.readouterr().err
    assert "8 generated" in err and "tok/s" in err


@pytest.mark.parametrize(
    "argv,words",
    [
        (["generate", "--model", "/nonexistent", "--prompt", "x"], "not a directory"),
        (["generate", "--model", "demo", "--prompt", "x", "--top-p", "2"], "top_p"),
        (["logits", "--model", "demo", "--prompt-ids", "1,a", "--out", "x.npy"], "integer"),
        (["logits", "--model", "demo", "--prompt-ids", "@/no/file", "--out", "x.npy"], "read"),
        (["logits", "--model", "demo", "--prompt-ids", "999999", "--out", "x.npy"], "vocabulary"),
        (["logits", "--model", "demo", "--prompt-ids", " , ", "--out", "x.npy"], "no token ids"),
        (["make-checkpoint", "x", "--hidden", "100"], "hidden_size"),
        (
            ["serve", "--model", "demo", "--engine", "cpu", "--kv-cache-dtype", "fp8"],
            "needs the GPU engine",
        ),
        (
            [
                "serve",
                "--model",
                "demo",
                "--engine",
                "gpu",
                "--dtype",
                "float32",
                "--kv-cache-dtype",
                "fp8",
            ],
            "needs bf16 activations",
        ),
    ],
)
def test_errors_are_one_line_exit_2(
    argv: list[str], words: str, use_demo_cache: Path, capsys: pytest.CaptureFixture
) -> None:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gptoss-serve {argv[0]}: error:") and words in err
    assert "Traceback" not in err


def test_broken_checkpoint_is_a_clean_error(tiny_dir: Path, capsys: pytest.CaptureFixture) -> None:
    (tiny_dir / "model.safetensors").write_bytes(b"\x00" * 10)
    argv = ["logits", "--model", str(tiny_dir), "--prompt-ids", "1", "--out", "x.npy"]
    assert cli.main(argv) == 2
    assert "truncated or corrupt" in capsys.readouterr().err


def test_console_entry_point_help() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gptoss_serve.cli", "--help"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0
    for command in ("generate", "logits", "make-checkpoint"):
        assert command in result.stdout
