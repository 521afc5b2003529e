"""The single-process engine every DP rank runs: state cache, scheduler, runner, sampling, offline API.

No Ray here: an actor wraps `Engine`; `LLM` drives one in the current process.
"""

from rackserve.engine.engine import Engine, RequestError
from rackserve.engine.grammar import GrammarError, GrammarSpec
from rackserve.engine.llm import LLM
from rackserve.engine.request import Completion, RequestOutput
from rackserve.engine.sampling import SamplingParams
from rackserve.engine.state_cache import StateCache

__all__ = ["Completion", "Engine", "GrammarError", "GrammarSpec", "LLM", "RequestError", "RequestOutput",
           "SamplingParams", "StateCache"]
