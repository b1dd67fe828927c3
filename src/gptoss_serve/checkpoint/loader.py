"""Load a gpt-oss checkpoint: ``model.safetensors`` or shards + ``model.safetensors.index.json``.

Everything is validated against the name map (layout.py) before a single tensor is read:
missing, unexpected, wrong shape or dtype, unreadable or truncated files. Loading then either
returns every tensor or raises; nothing is half-loaded silently. MXFP4 expert tensors stay
packed uint8; the rest stay bf16 (the model casts them to its compute dtype).

``load_checkpoint`` returns the whole dict (the plain-torch model); ``validate_checkpoint``
then ``read_checkpoint`` stream it tensor by tensor (the GPU engine, which builds each layer
as soon as its tensors are in and so never holds the model twice).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from gptoss_serve.checkpoint.layout import CheckpointError, TensorSpec, expected_tensors
from gptoss_serve.config import ModelConfig

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def checkpoint_files(model_dir: Path) -> dict[str, list[str]]:
    """Map each safetensors file of the checkpoint to the tensor names it should hold."""
    index_path = model_dir / INDEX_FILE
    if index_path.exists():
        try:
            index = json.loads(index_path.read_text())
            weight_map = index["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise CheckpointError(
                f"{index_path}: not a valid safetensors index ({error})"
            ) from error
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path}: 'weight_map' must be an object")
        files: dict[str, list[str]] = {}
        for name, file_name in weight_map.items():
            files.setdefault(file_name, []).append(name)
        return files
    if (model_dir / SINGLE_FILE).exists():
        return {SINGLE_FILE: []}  # names come from the file's own header
    shards = sorted(p.name for p in model_dir.glob("model-*-of-*.safetensors"))
    if shards:
        raise CheckpointError(f"{model_dir}: sharded checkpoint without {INDEX_FILE}")
    raise CheckpointError(f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE} found")


def load_checkpoint(
    model_dir: str | Path, config: ModelConfig, device: str | torch.device = "cpu"
) -> dict[str, torch.Tensor]:
    """Return every tensor of the checkpoint by name, validated against ``config``."""
    model_dir = Path(model_dir)
    return dict(read_checkpoint(model_dir, validate_checkpoint(model_dir, config), device))


def validate_checkpoint(model_dir: str | Path, config: ModelConfig) -> dict[str, list[str]]:
    """Check every header against ``config`` before any data is read; raise CheckpointError on
    the first problem. Returns each file's tensor names, in the file's order."""
    model_dir = Path(model_dir)
    expected = expected_tensors(config)
    located: dict[str, str] = {}
    contents: dict[str, list[str]] = {}
    for file_name, indexed_names in checkpoint_files(model_dir).items():
        path = model_dir / file_name
        with _open(path) as handle:
            names = list(handle.keys())
            missing_here = set(indexed_names) - set(names)
            if missing_here:
                name = sorted(missing_here)[0]
                raise CheckpointError(
                    f"{path}: tensor '{name}' is listed in {INDEX_FILE} but absent"
                )
            for name in names:
                if name not in expected:
                    raise CheckpointError(f"{path}: unexpected tensor '{name}'")
                if name in located:
                    raise CheckpointError(f"{path}: tensor '{name}' also in {located[name]}")
                _check_header(path, handle, expected[name])
                located[name] = file_name
        contents[file_name] = names
    for name in expected:
        if name not in located:
            raise CheckpointError(f"{model_dir}: missing tensor '{name}'")
    return contents


def read_checkpoint(
    model_dir: str | Path, contents: dict[str, list[str]], device: str | torch.device = "cpu"
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) file by file, each read straight to ``device``; ``contents`` is what
    validate_checkpoint returned. One tensor at a time, so a consumer that keeps only what it
    needs never holds a second copy of the model."""
    model_dir = Path(model_dir)
    for file_name, names in contents.items():
        path = model_dir / file_name
        with _open(path, device) as handle:
            for name in names:
                try:
                    tensor = handle.get_tensor(name)
                except SafetensorError as error:
                    raise CheckpointError(
                        f"{path}: tensor '{name}' unreadable ({error})"
                    ) from error
                yield name, tensor
        logger.info("loaded %s", path)


def _open(path: Path, device: str | torch.device = "cpu"):
    if not path.exists():
        raise CheckpointError(f"{path}: file not found")
    try:
        return safe_open(str(path), framework="pt", device=str(device))
    except SafetensorError as error:
        raise CheckpointError(f"{path}: truncated or corrupt safetensors file ({error})") from error


def _check_header(path: Path, handle, spec: TensorSpec) -> None:
    view = handle.get_slice(spec.name)
    shape, dtype = tuple(view.get_shape()), view.get_dtype()
    if dtype != spec.dtype:
        raise CheckpointError(
            f"{path}: tensor '{spec.name}' has dtype {dtype}, expected {spec.dtype}"
        )
    if shape != spec.shape:
        raise CheckpointError(
            f"{path}: tensor '{spec.name}' has shape {list(shape)}, expected {list(spec.shape)}"
        )
