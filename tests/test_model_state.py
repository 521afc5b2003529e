"""Our model on its own: per-request state memory, and the indexer's top-k with fewer slots than entries."""

from __future__ import annotations

import pytest
import torch

from helpers import new_state, prompt, step
from rackserve.models.deepseek_v4.config import CSA
from rackserve.models.deepseek_v4 import ForwardBatch, load_model


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    return load_model(tiny_checkpoint)


def test_chunked_equals_one_shot_when_the_indexer_drops_entries(tiny):
    # index_topk = 8 while a 300-token prompt has up to 75 CSA entries: selection must not depend on
    # how the prompt is chunked or batched
    ids = prompt(300, seed=0)
    state = new_state(tiny)
    one_shot = step(tiny, state, [(state.allocate(), ids)], all_logits=True)
    for chunk in (7, 128):
        state = new_state(tiny)
        handle = state.allocate()
        chunked = torch.cat([step(tiny, state, [(handle, ids[i:i + chunk])], all_logits=True)
                             for i in range(0, len(ids), chunk)])
        assert (chunked - one_shot).abs().max() < 1e-4


def test_indexer_keeps_the_top_k_and_breaks_ties_by_lowest_index(tiny):
    layer = tiny.config.layer_types.index(CSA)
    indexer = tiny.model.layers[layer].self_attn.compressor.indexer
    cache = new_state(tiny)
    handle = cache.allocate()
    step(tiny, cache, [(handle, prompt(150, seed=1))])
    keys = cache.state.index_key_rows(layer)
    keys[::3] = 0  # every third entry scores exactly 0: many exact ties
    assert cache.reserve(handle, 160)
    batch = ForwardBatch.build(cache.state, [(handle, prompt(10, seed=2))])
    plan = batch.plans[CSA]
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, tiny.config.hidden_size, generator=g)
    q_residual = torch.randn(10, tiny.config.q_lora_rank, generator=g)
    rotary = tiny.rotary(CSA)
    with torch.no_grad():
        chosen, valid = indexer.select(x, q_residual, batch.positions, plan, keys, rotary)

        # brute force, one token and one entry at a time
        from rackserve.models.deepseek_v4.rope import apply_rope
        heads, dim = indexer.heads, indexer.dim
        q = indexer.q_b_proj(q_residual).view(10, heads, dim)
        q = apply_rope(q, *rotary.cos_sin(batch.positions, q.dtype))
        head_w = indexer.scorer.weights_proj(x) * heads**-0.5
    k = indexer.topk
    exact_ties = 0
    for t in range(10):
        seen = int(batch.positions[t] + 1) // tiny.config.csa_compress_rate
        rows = plan.visible_row[t, :seen]
        scores = [float(sum(head_w[t, h] * torch.relu(q[t, h] @ keys[r]) * dim**-0.5 for h in range(heads)))
                  for r in rows]
        picked = chosen[t][valid[t]].tolist()
        assert len(picked) == min(k, seen) and all(e < seen for e in picked)
        ranked = sorted(range(seen), key=lambda e: (-scores[e], e))
        # the k-th best score bounds every pick from below; exact ties at the boundary go to the lowest index
        kth = scores[ranked[len(picked) - 1]]
        assert all(scores[e] >= kth - 1e-6 for e in picked)
        assert all(scores[e] <= kth + 1e-6 for e in set(range(seen)) - set(picked))
        tied = [e for e in range(seen) if scores[e] == kth]
        exact_ties += len(tied) > 1
        if len(tied) > 1:
            taken = [e for e in picked if scores[e] == kth]
            assert taken == sorted(tied)[: len(taken)]
    assert exact_ties  # the tie rule was really exercised


def test_batch_rejects_requests_without_room(tiny):
    cache = new_state(tiny)
    handle = cache.allocate()
    with pytest.raises(ValueError, match=r"reserve pages first"):
        ForwardBatch.build(cache.state, [(handle, prompt(20, seed=0))])


def test_import_of_a_foreign_layout_is_refused(tiny):
    cache = new_state(tiny)
    handle = cache.allocate()
    step(tiny, cache, [(handle, prompt(20, seed=0))])
    blob = cache.export(handle)
    blob.tensors = blob.tensors[1:]
    with pytest.raises(ValueError, match="same model config"):
        cache.import_(blob)


def test_state_through_bytes_continues_exactly(tiny):
    """export_into a byte buffer (what travels over NIXL), import_from it into another cache: the
    next tokens' logits are bit-identical to continuing in place."""
    ids, more = prompt(77, seed=4), prompt(9, seed=5)
    src = new_state(tiny)
    handle = src.allocate()
    step(tiny, src, [(handle, ids)])
    buf = torch.zeros(src.state.blob_nbytes(handle.num_tokens) + 64, dtype=torch.uint8)  # slack is ignored
    src.state.export_into(handle, buf)
    assert src.state.blob_nbytes(77) == src.state.slot_bytes + src.state.pages_for(77) * src.state.page_bytes

    dst = new_state(tiny)
    dst.allocate()  # a different slot and pages than the source's
    moved = dst.allocate()
    assert dst.reserve(moved, 77)
    dst.state.import_from(moved, buf, 77)
    assert moved.num_tokens == 77
    want = step(tiny, src, [(handle, more)], all_logits=True)
    got = step(tiny, dst, [(moved, more)], all_logits=True)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="needs .* uint8"):
        dst.state.import_from(moved, buf[:100], 77)
