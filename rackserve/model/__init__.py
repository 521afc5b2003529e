"""DeepSeek-V4 for serving: the model, its per-request state, the weight loader and the tiny checkpoint."""

from rackserve.model.batch import ForwardBatch
from rackserve.model.deepseek_v4 import DeepseekV4ForCausalLM
from rackserve.model.loader import CheckpointError, load_model
from rackserve.model.state import ModelState, RequestState, StateBlob

__all__ = ["CheckpointError", "DeepseekV4ForCausalLM", "ForwardBatch", "ModelState", "RequestState", "StateBlob",
           "load_model"]
