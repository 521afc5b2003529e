"""The shell every family's model shares: its body (`model`, with `embed_tokens`), the output head
(`lm_head`, tied to the embeddings when the config says so) and the dtype and device the engine asks
for (`ServingModel`). Module names follow Hugging Face checkpoints (`model.…`, `lm_head.weight`)."""

from __future__ import annotations

import torch
from torch import nn

from rackserve.models.moe import RoutedMoE


class CausalLM(nn.Module):
    def __init__(self, config, body: nn.Module):
        """config: the family's (`hidden_size`, `vocab_size`, `tie_word_embeddings`); body: its decoder stack."""
        super().__init__()
        self.config = config
        self.model = body
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = body.embed_tokens.weight

    def materialize(self, device: torch.device | str) -> None:
        """Uninitialised storage on `device` for every tensor of a model built on the meta device, the head
        tied again where the config ties it, and the slot maps of experts sharded there rebuilt.

        Not `Module.to_empty`: its `empty_like` of a meta tensor runs torch's Python reference ops, whose
        first call costs a process 0.3 s of imports."""
        self._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        for layer in self.modules():
            if isinstance(layer, RoutedMoE) and layer.ep is not None:  # sharded on the meta device: its slot
                layer.set_layout(layer.layout)  # maps are garbage now

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device


class Embedding(nn.Embedding):
    """`nn.Embedding` without its random initialisation. Every model here is built on the meta device and
    then loaded (or filled by a tiny checkpoint's own seeded draws); nn.Embedding's `normal_` on the meta
    device runs through torch's reference ops, whose first call imports dynamo: 1.3 s of each process's start."""

    def reset_parameters(self) -> None:
        pass
