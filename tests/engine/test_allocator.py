"""The engine process's allocator settings (engine/allocator.py): expandable segments unless the
user configured the allocator, set by the CLI before CUDA starts, and on a GPU really in force."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gptoss_serve import cli
from gptoss_serve.engine import allocator
from gptoss_serve.engine.allocator import ALLOC_CONF_VARS, ENGINE_ALLOC_CONF, configure_allocator

REPO = Path(__file__).resolve().parents[2]


def test_expandable_segments_when_nothing_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator.torch.cuda, "is_initialized", lambda: False)
    environ: dict[str, str] = {"OTHER": "1"}
    assert configure_allocator(environ) == ENGINE_ALLOC_CONF
    assert environ == {"OTHER": "1", "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


@pytest.mark.parametrize("name", ALLOC_CONF_VARS)
def test_the_users_setting_is_kept(name: str) -> None:
    environ = {name: "max_split_size_mb:512"}
    assert configure_allocator(environ) == "max_split_size_mb:512"
    assert environ == {name: "max_split_size_mb:512"}  # nothing added beside it either


def test_too_late_once_cuda_started(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    monkeypatch.setattr(allocator.torch.cuda, "is_initialized", lambda: True)
    environ: dict[str, str] = {}
    with caplog.at_level(logging.WARNING, logger=allocator.__name__):
        assert configure_allocator(environ) is None
    assert environ == {}
    assert "CUDA started before the allocator was configured" in caplog.text


def test_the_cli_configures_it_before_a_command_runs(tmp_path: Path, monkeypatch) -> None:
    # A private environment without either variable: what cli.main sets stays in this test.
    private = {k: v for k, v in os.environ.items() if k not in ALLOC_CONF_VARS}
    monkeypatch.setattr(os, "environ", private)
    seen = {}

    def make_checkpoint(args) -> int:  # the command sees the variable already set
        seen.update({name: os.environ.get(name) for name in ALLOC_CONF_VARS})
        return 0

    monkeypatch.setitem(cli.COMMANDS, "make-checkpoint", make_checkpoint)
    if torch.cuda.is_initialized():  # an earlier GPU test in this process started CUDA
        monkeypatch.setattr(allocator.torch.cuda, "is_initialized", lambda: False)
    assert cli.main(["make-checkpoint", str(tmp_path / "ck")]) == 0
    assert seen == {"PYTORCH_ALLOC_CONF": None, "PYTORCH_CUDA_ALLOC_CONF": ENGINE_ALLOC_CONF}


# A 256 MiB block freed, then 128 MiB allocated into it: with fixed segments the other half
# stays reserved after empty_cache (a hole between live tensors, as loading leaves them); with
# expandable segments its pages go back.
_HOLE_SCRIPT = """
import torch
from gptoss_serve.engine.allocator import configure_allocator
print(configure_allocator())
block = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
del block
kept = torch.empty(128 << 20, dtype=torch.uint8, device="cuda")
torch.cuda.empty_cache()
print(torch.cuda.memory_reserved() >> 20)
"""


def _reserved_mib_after_hole(extra_env: dict[str, str]) -> tuple[str, int]:
    env = {k: v for k, v in os.environ.items() if k not in ALLOC_CONF_VARS} | extra_env
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", _HOLE_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300, check=True)  # fmt: skip
    setting, reserved = done.stdout.split()
    return setting, int(reserved)


@pytest.mark.gpu
def test_gpu_the_setting_takes_effect_after_torch_is_imported() -> None:
    """torch is imported before ``configure_allocator`` runs (as in the CLI); the allocator
    must still start with expandable segments and hand the hole back."""
    setting, reserved = _reserved_mib_after_hole({})
    assert setting == ENGINE_ALLOC_CONF
    # 128 MiB in 2 MiB pages plus the allocator's own mapping granularity (140 on an H100)
    assert reserved < 200, f"{reserved} MiB reserved: expandable segments not in force"
    # The control: fixed segments keep the hole (the test can tell the two apart).
    setting, reserved = _reserved_mib_after_hole(
        {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False"}
    )
    assert setting == "expandable_segments:False"
    assert reserved >= 256, f"{reserved} MiB reserved with fixed segments"
