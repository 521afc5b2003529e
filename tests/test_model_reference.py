"""Our DeepSeek-V4 against transformers' DeepseekV4ForCausalLM on the same safetensors, in fp32.

Tolerance: max abs logit difference < 1e-4 (fp32 rounding; observed ≈ 2e-6 … 6e-6 with logits of
magnitude ≈ 5). Both tiny configs are run: V4's default layer schedule, and a small window with
small compress rates so that 300 tokens cross many window and compression boundaries.
"""

from __future__ import annotations

import pytest
import torch

from helpers import new_state, prompt, step

ATOL = 1e-4


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@torch.no_grad()
def reference_logits(reference, ids: list[int]) -> torch.Tensor:
    return reference(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module")
def prefill_300(ours, reference):
    ids = prompt(300, seed=0)
    state = new_state(ours)
    got = step(ours, state, [(state.allocate(), ids)], all_logits=True)
    return ids, got, reference_logits(reference, ids)


def test_one_shot_prefill_matches_reference(prefill_300):
    _, got, want = prefill_300
    assert got.shape == want.shape == (300, 512)
    assert max_diff(got, want) < ATOL


@pytest.mark.parametrize("chunk", [1, 7, 37, 128])
def test_chunked_prefill_equals_one_shot(ours, prefill_300, chunk):
    ids, one_shot, want = prefill_300
    state = new_state(ours)
    handle = state.allocate()
    parts = [step(ours, state, [(handle, ids[i:i + chunk])], all_logits=True) for i in range(0, len(ids), chunk)]
    chunked = torch.cat(parts)
    assert max_diff(chunked, one_shot) < ATOL
    assert max_diff(chunked, want) < ATOL


def test_64_decode_steps_match_reference_cache(ours, reference):
    ids = prompt(150, seed=1)
    with torch.no_grad():
        out = reference(torch.tensor([ids]), use_cache=True)
    cache, want = out.cache, out.logits[0, -1]
    state = new_state(ours)
    handle = state.allocate()
    got = step(ours, state, [(handle, ids)])[0]
    diffs = [max_diff(got, want)]
    for _ in range(64):
        # both sides are fed the reference's greedy token, so a near-tie cannot make them diverge
        token = int(want.argmax())
        with torch.no_grad():
            out = reference(torch.tensor([[token]]), cache=cache, use_cache=True)
        cache, want = out.cache, out.logits[0, -1]
        got = step(ours, state, [(handle, [token])])[0]
        diffs.append(max_diff(got, want))
    assert handle.num_tokens == 150 + 64
    assert max(diffs) < ATOL, diffs


# (history length, new tokens) per request: fresh prefills, decodes and mid-prompt chunks, ragged.
RAGGED = [(0, 37), (100, 1), (50, 20), (0, 1), (9, 128), (263, 1)]


def test_ragged_batch_equals_each_alone(ours):
    histories = [prompt(h, seed=10 + i) for i, (h, _) in enumerate(RAGGED)]
    news = [prompt(n, seed=20 + i) for i, (_, n) in enumerate(RAGGED)]

    alone = []
    for hist, new in zip(histories, news):
        state = new_state(ours, slots=1)
        handle = state.allocate()
        if hist:
            step(ours, state, [(handle, hist)])
        alone.append(step(ours, state, [(handle, new)], all_logits=True))

    state = new_state(ours, slots=len(RAGGED))
    handles = [state.allocate() for _ in RAGGED]
    for handle, hist in zip(handles, histories):
        if hist:
            step(ours, state, [(handle, hist)])
    together = step(ours, state, list(zip(handles, news)), all_logits=True)
    split = together.split([len(n) for n in news])
    for i, (a, b) in enumerate(zip(alone, split)):
        assert max_diff(a, b) < 1e-5, f"request {i} {RAGGED[i]}"


def test_exported_state_continues_identically(ours):
    source = new_state(ours, slots=2)
    handle = source.allocate()
    step(ours, source, [(handle, prompt(45, seed=3))])  # mid-window: the carry is not empty
    blob = source.export(handle)
    assert blob.nbytes == source.state.slot_bytes + source.pages_for(45) * source.state.page_bytes

    # a different shape of state memory, with other requests already in it: other slot and pages
    target = new_state(ours, slots=5, budget_mb=8)
    for _ in range(3):
        other = target.allocate()
        assert target.reserve(other, 100)
    imported = target.import_(blob)
    assert imported is not None and imported.slot != handle.slot and imported.pages[0] != handle.pages[0]
    assert imported.num_tokens == 45

    cont = [prompt(13, seed=4)] + [[t] for t in prompt(20, seed=5)]
    for new in cont:
        a = step(ours, source, [(handle, new)], all_logits=True)
        b = step(ours, target, [(imported, new)], all_logits=True)
        assert torch.equal(a, b)
