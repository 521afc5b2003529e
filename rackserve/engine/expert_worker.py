"""An expert rank of attention–FFN split mode: routed-expert slots of every MoE layer, no attention.

The attention (DP) ranks run the model; at each MoE layer they dispatch tokens to the ranks holding
the chosen experts. An expert rank holds slots only, so its step is: the host sync, then for each
forward pass the gang runs, its part of every MoE layer in order (the MTP layer's last, with
speculative decoding, where the drafter's follow runs one), then its part of the draft model's MoE for
each draft forward, then EPLB when due,
exactly as the DP ranks' engines do it, so every exchange of the gang is matched.
"""

from __future__ import annotations

import numpy as np
import torch

from rackserve.config import EngineConfig
from rackserve.engine.gang import ExpertBalancer, Gang, sync
from rackserve.models.moe import RoutedMoE
from rackserve.timing import phase


class ExpertWorker:
    def __init__(self, layers: list[RoutedMoE], gang: Gang, config: EngineConfig, draft_layers: list[RoutedMoE] = (),
                 follow_layers: list[RoutedMoE] = ()):
        """layers: the model's MoE layers, already sharded to this rank's slots (`MoE.shard`);
        draft_layers: the draft model's (`draft_moe_layers`, a draft forward's), and follow_layers those of
        them a follow runs each pass (`follow_moe_layers`), run when `config` speculates."""
        self.layers, self.gang = layers, gang
        self.draft_layers = list(draft_layers) if config.speculative_tokens else []
        self.follow_layers = list(follow_layers) if config.speculative_tokens else []
        self.balancer = ExpertBalancer(layers, gang, config.eplb_interval, config.eplb_min_gain, self.draft_layers)
        self.gang_tokens = np.zeros(gang.world_size, np.int64)  # tokens each member ran in the last step
        self.gang_busy = False  # whether a DP rank waits on a transfer (the gang keeps stepping)

    @torch.inference_mode()
    def step(self) -> int:
        """One gang step; returns its forward passes (see `gang_busy` when 0)."""
        with phase("host sync"):
            self.gang_tokens, num_passes, num_drafts, self.gang_busy = sync(self.gang, 0, 0)
        # as a DP rank runs them: each pass the main layers then the follow's, then the draft forwards
        for _ in range(num_passes):
            for layer in self.layers + self.follow_layers:
                layer.serve_experts()
        for _ in range(num_drafts):
            for layer in self.draft_layers:
                layer.serve_experts()
        if num_passes:
            with phase("eplb"):
                self.balancer.after_step()
        return num_passes

    def stats(self) -> dict:
        return {"steps": self.balancer.num_steps, **self.balancer.stats()}
