"""`ExpertRank`: an expert rank of an attention–FFN split instance, a thin actor over `ExpertWorker`."""

from __future__ import annotations

from rackserve.actors.gang_member import GangMember, GangSpec
from rackserve.engine.expert_worker import ExpertWorker


class ExpertRank(GangMember):
    role = "expert rank"
    reads_host_tables = False  # its tables stay lazily mapped from the files, never read

    def setup(self, spec: GangSpec, members: list) -> None:
        model, config = self._join(spec, members)
        # attention weights are dropped
        self.worker = ExpertWorker(model.moe_layers, self.gang, config, model.draft_moe_layers,
                                   model.follow_moe_layers)
        self._start()

    def _stats(self) -> dict:
        return self.worker.stats()

    def _step(self) -> bool:
        return self.worker.step() > 0 or self.worker.gang_busy
