"""`python -m rackserve.bench.soak` on the session's cluster, short: mixed requests (conversations,
fresh prompts, clients that leave, prompts refused), the decode rank killed half-way, then every
resource the deployment holds back at its idle value."""

from __future__ import annotations

import pytest

from rackserve.bench import soak


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_soak_with_a_fault_leaves_every_resource_at_its_idle_value(ray_cluster, tiny_checkpoint):
    figures = soak.run(requests=160, users=4, seed=1, checkpoint=str(tiny_checkpoint))
    assert figures["errors"] == 0, figures  # the killed rank's streams were replayed, none failed
    assert figures["done"] > 0 and figures["left"] > 0 and figures["refused"] > 0, figures
    assert figures["back_to_idle"], soak.table(figures)
    assert {k for k in figures["idle"] if k.endswith("kv_inbox_bytes_in_use")}, figures["idle"]
    assert "RSS MiB / 1,000 requests" in soak.table(figures)
