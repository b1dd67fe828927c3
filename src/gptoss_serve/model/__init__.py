"""The gpt-oss transformer in plain PyTorch (CPU and CUDA, float32 and bfloat16)."""

from gptoss_serve.model.kv_cache import KVCache
from gptoss_serve.model.transformer import GptOssForCausalLM, load_model

__all__ = ["GptOssForCausalLM", "KVCache", "load_model"]
