"""Shared fixtures: offline settings, random-weight checkpoints of several shapes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from gptoss_serve.checkpoint.demo import demo_checkpoint_dir
from gptoss_serve.checkpoint.synthetic import make_checkpoint
from gptoss_serve.engine.allocator import configure_allocator
from gptoss_serve.server.render_workers import RenderWorkers

REPO = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"

# openai-harmony's vocabulary: CI and `make` point at ../shared/vocab; do the same for a bare
# `pytest` run from a checkout that has it beside it. Offline: never reach for the HF hub.
_VOCAB = REPO.parent / "shared" / "vocab"
if "TIKTOKEN_ENCODINGS_BASE" not in os.environ and (_VOCAB / "o200k_base.tiktoken").exists():
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(_VOCAB)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The allocator as the served engine's process has it (cli.main does the same): CUDA has not
# started yet while pytest imports this file.
configure_allocator()


@pytest.fixture(scope="session", autouse=True)
def verified_fast_launches():
    """On a GPU, every Triton launch that skips Triton's binding (kernels/fast_launch.py) is
    checked against Triton's own choice of compiled kernel, in every test that launches one."""
    if not torch.cuda.is_available():
        yield
        return
    from gptoss_serve.kernels import fast_launch  # noqa: PLC0415

    fast_launch.set_verification(True)
    yield
    fast_launch.set_verification(False)


@pytest.fixture(autouse=True)
def lazy_render_workers(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Servers under test start their render workers at their first large prompt, as before
    the app started them with itself: a start costs ~1.5 s of a CI core, and the suite starts
    hundreds of servers, few of which render a large prompt. A test of the start-up itself is
    marked ``eager_render_workers``."""
    if "eager_render_workers" not in request.keywords:
        monkeypatch.setattr(RenderWorkers, "start", _not_at_start_up)


async def _not_at_start_up(self: RenderWorkers) -> None:
    del self


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# Three shapes for the transformers comparison: 8+ experts so selection matters, one sharded,
# different head groupings and head_dims (q_dim != hidden in all of them).
CHECKPOINT_SHAPES = {
    "tiny8": dict(preset="tiny", seed=1, vocab=1024),
    "sharded16": dict(
        preset="tiny", seed=2, vocab=777, layers=3, experts=16, hidden=64, intermediate=96,
        heads=4, kv_heads=1, head_dim=16, num_shards=3,
    ),
    "wide12": dict(
        preset="tiny", seed=3, vocab=2048, layers=2, experts=12, hidden=96, intermediate=64,
        heads=8, kv_heads=4, head_dim=64, num_shards=2,
    ),
}  # fmt: skip


@pytest.fixture(scope="session")
def checkpoint_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    dirs = {}
    for name, spec in CHECKPOINT_SHAPES.items():
        options = dict(spec)
        dirs[name] = make_checkpoint(root / name, options.pop("preset"), **options)
    return dirs


@pytest.fixture()
def tiny_dir(tmp_path: Path) -> Path:
    """A fresh small single-file checkpoint a test may damage."""
    return make_checkpoint(tmp_path / "tiny", "tiny", seed=5, vocab=256, layers=2)


@pytest.fixture(scope="session")
def demo_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo checkpoint (real vocabulary), written once per session."""
    return demo_checkpoint_dir(tmp_path_factory.mktemp("demo-cache"))


@pytest.fixture()
def scripted_engine():
    """An engine that replays queued Harmony token scripts (server_helpers.ScriptedEngine)."""
    from server_helpers import ScriptedEngine  # noqa: PLC0415  (a test helper module)

    return ScriptedEngine()


@pytest.fixture()
def scripted_client(scripted_engine):
    """A TestClient on the app over ``scripted_engine``, with an in-memory store."""
    from fastapi.testclient import TestClient  # noqa: PLC0415

    from gptoss_serve.config import ServerConfig  # noqa: PLC0415
    from gptoss_serve.server.app import create_app  # noqa: PLC0415
    from gptoss_serve.server.store import ResponseStore  # noqa: PLC0415

    app = create_app(scripted_engine, ResponseStore(":memory:"), ServerConfig())
    with TestClient(app) as test_client:
        yield test_client
