"""DeepSeek-V4 for serving: the model, its per-request state, the weight loader and the tiny checkpoint.
Registered as the `deepseek_v4` family (`rackserve.models`)."""

import functools

from rackserve.models import register
from rackserve.models.deepseek_v4.batch import ForwardBatch
from rackserve.models.deepseek_v4.chat import V4, encode_chat
from rackserve.models.deepseek_v4.config import ModelConfig
from rackserve.models.deepseek_v4.loader import CheckpointError, load_model
from rackserve.models.deepseek_v4.model import DeepseekV4ForCausalLM
from rackserve.models.deepseek_v4.state import ModelState, RequestState, StateBlob
from rackserve.models.interface import ModelFamily
from rackserve.models.reply import DEEPSEEK_V4

register(ModelFamily("deepseek_v4", ModelConfig.from_dict, load_model, ModelState, DeepseekV4ForCausalLM,
                     chat=functools.partial(encode_chat, V4), reply=DEEPSEEK_V4))

__all__ = ["CheckpointError", "DeepseekV4ForCausalLM", "ForwardBatch", "ModelConfig", "ModelState", "RequestState",
           "StateBlob", "load_model"]
