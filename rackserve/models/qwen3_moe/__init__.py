"""Qwen3-MoE for serving: the model, its paged KV cache, the weight loader and a tiny checkpoint made
by transformers. Registered as the `qwen3_moe` family (`rackserve.models`)."""

from rackserve.models import register
from rackserve.models.checkpoint import CheckpointError
from rackserve.models.interface import ModelFamily
from rackserve.models.qwen3_moe.batch import ForwardBatch
from rackserve.models.qwen3_moe.config import ModelConfig
from rackserve.models.qwen3_moe.loader import load_model
from rackserve.models.qwen3_moe.model import Qwen3MoeForCausalLM
from rackserve.models.qwen3_moe.state import KVCache
from rackserve.models.reply import QWEN3

register(ModelFamily("qwen3_moe", ModelConfig.from_dict, load_model, KVCache, reply=QWEN3))

__all__ = ["CheckpointError", "ForwardBatch", "KVCache", "ModelConfig", "Qwen3MoeForCausalLM", "load_model"]
