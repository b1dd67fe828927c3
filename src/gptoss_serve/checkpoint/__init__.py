"""Checkpoint I/O: the on-disk layout of gpt-oss (HF safetensors, MXFP4 experts kept packed)."""

from gptoss_serve.checkpoint.layout import CheckpointError, TensorSpec, expected_tensors
from gptoss_serve.checkpoint.loader import load_checkpoint, read_checkpoint, validate_checkpoint

__all__ = [
    "CheckpointError",
    "TensorSpec",
    "expected_tensors",
    "load_checkpoint",
    "read_checkpoint",
    "validate_checkpoint",
]
