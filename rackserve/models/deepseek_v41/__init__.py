"""DeepSeek-V4.1 for serving (`model_type: deepseek_v41`): the model, its per-request state, the weight
loader, the Engram memory and the tiny checkpoint. Registered as the `deepseek_v41` family
(`rackserve.models`). `FLASH_CONFIG` is DeepSeek-V4.1-Flash's published config.json (shapes only: what
`rackserve memory` reports on when no checkpoint is at hand)."""

import functools
from pathlib import Path

from rackserve.models import register
from rackserve.models.deepseek_v4.chat import V41, encode_chat
from rackserve.models.deepseek_v41.config import ModelConfig
from rackserve.models.deepseek_v41.loader import host_tables, load_model
from rackserve.models.deepseek_v41.model import DeepseekV41ForCausalLM
from rackserve.models.deepseek_v41.state import ModelState
from rackserve.models.interface import ModelFamily
from rackserve.models.reply import DEEPSEEK_V41

FLASH_CONFIG = Path(__file__).parent / "flash_config.json"

register(ModelFamily("deepseek_v41", ModelConfig.from_dict, load_model, ModelState, DeepseekV41ForCausalLM,
                     chat=functools.partial(encode_chat, V41), reply=DEEPSEEK_V41,
                     host_tables=host_tables))

__all__ = ["FLASH_CONFIG", "DeepseekV41ForCausalLM", "ModelConfig", "load_model"]
