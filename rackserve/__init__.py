"""rackserve: serve DeepSeek-V4-family MoE models across GPU racks on Ray."""

__version__ = "0.1.0"

# `rackserve.LLM` and `rackserve.SamplingParams` load lazily, so that light users of the package
# (the host collective, the planner) do not import torch.
_LAZY = {"LLM": "rackserve.engine.llm", "SamplingParams": "rackserve.engine.sampling"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'rackserve' has no attribute {name!r}")
