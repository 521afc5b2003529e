"""Every request field of OpenAI's and vLLM's `/v1/completions` and `/v1/chat/completions` schemas, and
what this server does with it: no field is accepted and ignored.

A field is either *honoured* (parsed by `rackserve.serve.protocol` and carried to the engine), or
*refused* unless it asks for what this server does anyway (its default, or JSON null): a value that
changes the output in a way not implemented here gets a 400 naming the field and why. A field in
neither list, in no schema we know, is a 400 too: a misspelt `temperture` would otherwise be ignored.
The lists follow OpenAI's Python client (3.57) and vLLM's protocol (0.32).
"""

from __future__ import annotations

from typing import Any

_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
             "skip_special_tokens", "frequency_penalty", "presence_penalty", "repetition_penalty", "logit_bias",
             "min_tokens", "bad_words", "allowed_token_ids", "max_tokens", "stream", "stream_options", "logprobs",
             "n", "response_format", "structured_outputs", "return_tokens_as_token_ids")
# user, prompt_cache_key: the routing session (`protocol.session_of`)
HONOURED = {
    "completions": frozenset({"model", "prompt", "echo", "user", "prompt_cache_key", *_SAMPLING}),
    "chat": frozenset({"model", "messages", "top_logprobs", "max_completion_tokens", "user", "prompt_cache_key",
                       "tools", "tool_choice", "parallel_tool_calls", "reasoning_effort", "chat_template_kwargs",
                       "include_reasoning", *_SAMPLING}),
    # vLLM's /tokenize (a prompt, or chat messages) and /detokenize
    "tokenize": frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                           "return_token_strs", "tools", "chat_template_kwargs"}),
    "detokenize": frozenset({"model", "tokens"}),
}

_CHAT_ONLY = "tools and reasoning are chat features: use /v1/chat/completions"
_LEGACY_FUNCTIONS = "the legacy functions API is not served: send tools and tool_choice"
_BEAM = "this server does not run beam search"
_STORE = "this server stores no completions"
_MULTIMODAL = "rackserve serves text only"
_TEXT_OUT = "responses carry text (token ids only in logprobs, with return_tokens_as_token_ids)"
# field -> (the values that ask for nothing beyond what this server does, why another value is refused)
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    # OpenAI
    "best_of": ((1,), "one candidate is generated per choice"),
    "suffix": (("",), "this server does not insert text"),
    "tools": (([],), _CHAT_ONLY),
    "tool_choice": (("none",), _CHAT_ONLY),
    "parallel_tool_calls": ((True, False), _CHAT_ONLY),  # means nothing without tools
    "functions": (([],), _LEGACY_FUNCTIONS),
    "function_call": (("none",), _LEGACY_FUNCTIONS),
    "audio": ((), _MULTIMODAL),
    "modalities": ((["text"],), _MULTIMODAL),
    "prediction": ((), "predicted outputs are not used here; speculative decoding drafts its own"),
    "reasoning_effort": ((), _CHAT_ONLY),
    "verbosity": ((), "this server has no verbosity control"),
    "web_search_options": ((), "this server does not search the web"),
    "store": ((False,), _STORE),
    "metadata": (({},), _STORE),
    "service_tier": (("auto", "default"), "this server has one service tier"),
    "safety_identifier": ((), "this server does no abuse monitoring; use user for routing"),
    "moderation": ((), "this server does no moderation"),
    "prompt_cache_retention": ((), "the prefix cache keeps what memory allows; it has no retention setting"),
    "prompt_cache_options": ((), "the prefix cache keeps what memory allows; it has no options"),
    # vLLM
    "use_beam_search": ((False,), _BEAM),
    "length_penalty": ((1, 1.0), _BEAM),
    "watermarking": ((), "this server does not watermark"),
    "include_stop_str_in_output": ((False,), "the text ends before the stop string"),
    "spaces_between_special_tokens": ((True,), "special tokens are decoded as the tokenizer joins them"),
    "truncate_prompt_tokens": ((), "prompts are never truncated: a long one gets a 400"),
    "truncation_side": ((), "prompts are never truncated: a long one gets a 400"),
    "prompt_logprobs": ((), "prompt log-probabilities are not computed"),
    "logprob_token_ids": ((), "log-probabilities are of the chosen and top tokens only"),
    "prompt_embeds": ((), "prompts are text or token ids"),
    "add_special_tokens": ((True,), "a prompt is encoded with the model's BOS, as its tokenizer does"),
    "add_generation_prompt": ((True,), "the chat template always prompts the assistant's reply"),
    "continue_final_message": ((False,), "the chat template always prompts a new reply"),
    "documents": ((), "the chat template takes no documents"),
    "chat_template": ((), "the model's own chat template is used"),
    "chat_template_kwargs": (({},), _CHAT_ONLY),
    "media_io_kwargs": ((), _MULTIMODAL),
    "mm_processor_kwargs": ((), _MULTIMODAL),
    "mm_payload": ((), _MULTIMODAL),
    "return_mm_kwargs": ((False,), _MULTIMODAL),
    "priority": ((0,), "requests are served in arrival order"),
    "request_id": ((), "response ids are the server's"),
    "session_id": ((), "route a session with user, prompt_cache_key or the X-Session-Id header"),
    "return_token_ids": ((False,), _TEXT_OUT),
    "return_token_offsets": ((False,), _TEXT_OUT),
    "return_prompt_text": ((False,), _TEXT_OUT),
    "routed_experts_prompt_start": ((), "expert routing is not reported"),
    "cache_salt": ((), "the prefix cache is shared by every request"),
    "kv_transfer_params": ((), "prefill and decode are disaggregated by the deployment, not per request"),
    "ec_transfer_params": ((), "prefill and decode are disaggregated by the deployment, not per request"),
    "vllm_xargs": ((), "this server takes no extension arguments"),
    "repetition_detection": ((), "use repetition_penalty or frequency_penalty"),
    "thinking_token_budget": ((), "reasoning is bounded by max_tokens; set reasoning_effort for less of it"),
    "include_reasoning": ((True,), _CHAT_ONLY),
    "stream_interval": ((1,), "every step's tokens are streamed as they come"),
}
# the chat endpoint's `echo` is vLLM's (echo the last message); the completions one is honoured
CHAT_REFUSED = {**REFUSED, "echo": ((False,), "the reply does not repeat the last message"),
                "add_special_tokens": ((False,), "the chat template places the special tokens")}
