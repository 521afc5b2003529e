"""`rackserve.LLM`: offline generation in one process.

    llm = LLM("tiny")                      # the built-in tiny checkpoint (made once, cached)
    [c] = llm.generate("The rack hums", SamplingParams(max_tokens=16, temperature=0))
    for out in llm.stream("The rack hums"):
        print(out.new_text, end="")
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

from rackserve.config import EngineConfig
from rackserve.engine.engine import Engine
from rackserve.engine.request import Completion, RequestOutput
from rackserve.engine.sampling import SamplingParams
from rackserve.models import load_model, resolve
from rackserve.models.tokenizer import Tokenizer, prompt_ids

Prompt = str | Sequence[int]


class LLM:
    def __init__(self, model: str | Path = "tiny", **engine_kwargs):
        """`model` is "tiny" or a checkpoint directory of any registered family (`rackserve.models`);
        `engine_kwargs` are `EngineConfig` fields."""
        config = EngineConfig(**engine_kwargs)
        path = resolve(model)
        weights = load_model(path, dtype=config.dtype, device=config.device, weights=config.weights)
        tokenizer = Tokenizer(path) if (path / "tokenizer.json").is_file() else None
        self.engine = Engine(weights, tokenizer, config)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[Completion]:
        """Run every prompt to completion, batched; completions come back in prompt order (a prompt's
        n choices one after another, `Completion.index`)."""
        prompts = _as_list(prompts)
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts; pass one or one each")
        tokenizer = self.engine.tokenizer
        requests = [self.engine.add_request(prompt_ids(tokenizer, p), sp) for p, sp in zip(prompts, params)]
        outputs: dict[str, list[RequestOutput]] = {r.request_id: [] for r in requests}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.request_id in outputs:  # not a request a `stream` left open
                    outputs[out.request_id].append(out)
        return [c for r in requests for c in Completion.from_outputs(r.request_id, r.prompt_ids, outputs[r.request_id],
                                                                     logprobs=r.params.logprobs is not None)]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield each step's new tokens and text for one prompt (other queued work advances too; with
        n > 1 the choices' outputs interleave, told apart by `index`). Closing the iterator early
        aborts the request."""
        req = self.engine.add_request(prompt_ids(self.engine.tokenizer, prompt), params)
        try:
            while not req.all_finished:
                for out in self.engine.step():
                    if out.request_id == req.request_id:
                        yield out
        finally:
            if not req.all_finished:
                self.engine.abort(req.request_id)


def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt of token ids
    return prompts

