"""DeepSeek-V4.1 against the plain slow reference of `tests/v41_reference.py` on the same published files
(there is no transformers V4.1), in fp32, and each new piece on its own.

Tolerance: max |Δ logit| < 1e-4 (fp32 rounding; observed ≤ 6e-6 with logits of magnitude ≈ 5). The tiny
checkpoint's indexer keeps 6 entries among dozens and the candidate blocks 4 blocks of 2, so selection
and candidate masking decide most positions here; two index heads make many scores tie at exactly 0,
which both sides break by the same rule (lowest entry first).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import new_state, prompt, step
from rackserve import models
from rackserve.config import ConfigError
from rackserve.kernels.indexer import top_entries
from rackserve.models import load_model, read_config
from rackserve.models.checkpoint import CheckpointError
from rackserve.models.deepseek_v4.attention import Compressor
from rackserve.models.deepseek_v4.batch import ForwardBatch
from rackserve.models.deepseek_v41.attention import candidate_blocks
from rackserve.models.deepseek_v41.config import ModelConfig
from rackserve.models.deepseek_v41.engram import NgramHash, build_token_map, engram_layout, is_prime
from rackserve.models.deepseek_v41.tiny import TINY_TEXT_CONFIG
from rackserve.models.state import RequestState
from rackserve.models.tokenizer import train_byte_bpe

ATOL = 1e-4


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def model(v41_checkpoint):
    return load_model(v41_checkpoint)


# ---- the forward against the reference ---------------------------------------------------------------

@pytest.fixture(scope="module")
def prefill_150(model, v41_reference):
    ids = prompt(150, seed=0)
    cache = new_state(model)
    got = step(model, cache, [(cache.allocate(), ids)], all_logits=True)
    return ids, got, v41_reference.logits(ids)


def test_one_shot_prefill_matches_reference(prefill_150):
    _, got, want = prefill_150
    assert got.shape == want.shape == (150, 512)
    assert max_diff(got, want) < ATOL


@pytest.mark.parametrize("chunk", [1, 5, 13, 64])
def test_chunked_prefill_matches_reference(model, prefill_150, chunk):
    ids, _, want = prefill_150
    cache = new_state(model)
    handle = cache.allocate()
    got = torch.cat([step(model, cache, [(handle, ids[i:i + chunk])], all_logits=True)
                     for i in range(0, len(ids), chunk)])
    assert max_diff(got, want) < ATOL


def test_64_decode_steps_match_reference(model, v41_reference):
    """Decode is a one-shot prefill of the same tokens (DeepSeek's own decode path differs on ratio-2
    layers, see DEEPSEEK_V41.md): each step's logits equal the reference's at that position."""
    ids = prompt(70, seed=1)
    cache = new_state(model)
    handle = cache.allocate()
    steps = [step(model, cache, [(handle, ids)])[0]]
    for _ in range(64):
        ids.append(int(steps[-1].argmax()))
        steps.append(step(model, cache, [(handle, ids[-1:])])[0])
    want = v41_reference.logits(ids)[69:]
    assert max_diff(torch.stack(steps), want) < ATOL


# (history, new tokens) per request: fresh prefills, decodes and mid-prompt chunks, ragged
RAGGED = [(0, 37), (60, 1), (25, 20), (0, 1), (9, 40), (101, 1)]


def test_ragged_batch_with_requests_joining_matches_reference(model, v41_reference):
    cache = new_state(model, slots=len(RAGGED))
    histories = [prompt(h, seed=10 + i) for i, (h, _) in enumerate(RAGGED)]
    news = [prompt(n, seed=20 + i) for i, (_, n) in enumerate(RAGGED)]
    handles = [cache.allocate() for _ in RAGGED]
    # the requests join a running batch two at a time (their histories as prompts), while those already
    # in it decode a token each step
    for i in range(0, len(RAGGED), 2):
        decoding = [(handles[j], prompt(1, seed=100 * i + j)) for j in range(i) if histories[j]]
        joined = [(handles[j], histories[j]) for j in (i, i + 1) if histories[j]]
        step(model, cache, decoding + joined)
        for handle, token in decoding:
            j = handles.index(handle)
            histories[j] = histories[j] + token
    together = step(model, cache, list(zip(handles, news)), all_logits=True)
    for i, got in enumerate(together.split([len(n) for n in news])):
        want = v41_reference.logits(histories[i] + news[i])[len(histories[i]):]
        assert max_diff(got, want) < ATOL, f"request {i} {RAGGED[i]}"


def test_exported_state_continues_identically(model, v41_reference):
    source = new_state(model, slots=2)
    handle = source.allocate()
    ids = prompt(45, seed=3)  # odd: a ratio-2 group is half-filled, the lookback ring mid-way
    step(model, source, [(handle, ids)])
    blob = source.export(handle)
    assert blob.nbytes == source.state.slot_bytes + source.pages_for(45) * source.state.page_bytes

    target = new_state(model, slots=5, budget_mb=8)
    for _ in range(3):
        assert target.reserve(target.allocate(), 60)
    imported = target.import_(blob)
    assert imported.slot != handle.slot and imported.num_tokens == 45
    for new in [prompt(13, seed=4)] + [[t] for t in prompt(9, seed=5)]:
        a = step(model, source, [(handle, new)], all_logits=True)
        assert torch.equal(a, step(model, target, [(imported, new)], all_logits=True))
        ids += new
    assert max_diff(a, v41_reference.logits(ids)[-len(new):]) < ATOL


def test_rejected_speculative_tokens_leave_the_state_as_if_never_run(model):
    """A verify forward of 1 + 3 tokens whose last 2 are rejected, rolled back: every state row (windows,
    ratio-2 carries, entries, keys, the Engram lookback) is what a forward of the 2 kept tokens leaves."""
    cache = new_state(model, slots=2)
    a, b = cache.allocate(), cache.allocate()
    history, verify = prompt(30, seed=6), prompt(4, seed=7)
    for h in (a, b):
        step(model, cache, [(h, history)])
    step(model, cache, [(b, verify[:2])])
    assert cache.reserve(a, 34)
    batch = model.build_batch(cache.state, [(a, verify)])
    speculative = torch.tensor([False, True, True, True])
    undo = model.rollback(cache.state, batch, speculative)
    model(batch, cache.state)
    undo.undo(torch.tensor([False, False, True, True]))
    a.num_tokens += 2
    # the kept tokens' rows come from a 4-token forward there, a 2-token one here: equal up to fp32 rounding;
    # a row left as a rejected token wrote it would hold another token's values
    for x, y in zip(cache.state.export(a).tensors, cache.state.export(b).tensors):
        torch.testing.assert_close(x.float(), y.float(), atol=1e-5, rtol=0)


# ---- the pieces on their own ------------------------------------------------------------------------

def test_engram_hash_against_hand_computed_rows():
    """The rows of a few n-grams computed by hand: ids p, p-1, p-2, p-3 (pad before the start), a
    rolling XOR of id × multiplier, each n-gram's value modulo each head's prime plus its range's offset."""
    layout = engram_layout((1, 3), 4, 2, 32, 50, 300, 2)
    assert layout.primes == ((53, 59, 61, 67, 71, 73), (79, 83, 89, 97, 101, 103))
    assert [layout.rows(i) for i in range(2)] == [384, 552] and layout.offsets(1)[:3] == [0, 79, 162]
    hasher = NgramHash(layout, vocab_size=10)
    token_map = [7, 3, 9, 1, 4, 4, 8, 0, 2, 6]
    hasher.setup(token_map)
    cfg = ModelConfig.from_dict({"text_config": {**TINY_TEXT_CONFIG, "engram_layer_ids": [],
                                                 "vocab_size": 10, "dspark_noise_token_id": 9}})
    cache_state = models.new_state(cfg, 1, 4, 4)
    cache_state.lookback, cache_state.lookback_ids = 4, torch.zeros(1, 4, 1, dtype=torch.int32)
    handle = RequestState(slot=0, pages=[0, 1, 2])
    ids = [5, 1, 8, 3, 9]
    batch = ForwardBatch.build(cache_state, [(handle, ids)])
    rows = hasher(batch.input_ids, batch.lookback, cache_state.lookback_ids, batch.lookback_write)
    assert rows.shape == (2, 5, 6)
    pad = token_map[2]
    for layer in range(2):
        mult, primes, offsets = layout.multipliers[layer], layout.primes[layer], layout.offsets(layer)
        for p in range(5):
            grams = [token_map[ids[p - s]] if p - s >= 0 else pad for s in range(4)]
            rolling, want = grams[0] * mult[0], []
            for i in range(1, 4):
                rolling ^= grams[i] * mult[i]
                want += [rolling % primes[(i - 1) * 2 + h] + offsets[(i - 1) * 2 + h] for h in range(2)]
            assert rows[layer, p].tolist() == want, (layer, p)
    # the lookback ring keeps the last 4 token ids: a next chunk continues the n-grams
    assert sorted(cache_state.lookback_ids[0, :, 0].tolist()) == sorted(ids[1:])


def test_primes_are_the_next_unused_ones():
    assert [n for n in range(2, 60) if is_prime(n)] == [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59]
    assert is_prime(16000057) and not is_prime(16000057 * 3)  # V4.1-Flash's bucket range is near 16M
    flash = ModelConfig().engram
    assert [flash.rows(i) for i in range(2)] == [384006168, 384016682]
    assert flash.host_bytes == (384006168 + 384016682) * 264  # 188.8 GiB


def test_token_map_normalises_tricky_tokens():
    words = ["The", "the", "THE", "thé", "ÉCOLE", "école", " The", "ﬁ", "fi", "①", "1", "é", "e"]
    # each word often enough to be a token of its own
    tok = train_byte_bpe(400, [" ".join(words) + " \t\n  \r\n 日本語 🚀 Ünïcödé"] * 50 + [w for w in words for _ in range(50)])
    size = tok.get_vocab_size()
    lookup, compressed = build_token_map(tok, size + 20, pad_id=2)
    assert len(lookup) == size + 20 and lookup[size:] == [lookup[2]] * 20  # embedding padding rows map as pad
    by = {tok.decode([i], skip_special_tokens=False): lookup[i] for i in range(size)}
    same = [("The", "the"), ("THE", "the"), ("thé", "the"), ("ÉCOLE", "école"), ("é", "e"), ("ﬁ", "fi"),
            ("①", "1"), (" The", "The"), ("\t", " "), ("\n", " ")]
    for a, b in same:
        assert by[a] == by[b], (a, b)
    assert by[" "] not in {by[w] for w in words}  # a lone space keeps an id of its own (not stripped to "")
    assert by["<|pad|>"] != by["<|end_of_sentence|>"]  # special tokens stay themselves
    partial = [i for i in range(size) if "\ufffd" in tok.decode([i], skip_special_tokens=False)]
    assert partial and len({lookup[i] for i in partial}) == len(partial)  # partial UTF-8: one id per raw token
    assert compressed == len(set(lookup[:size]))


def test_csa2_pooling_by_hand():
    """Ratio 2: an entry is the norm of the two tokens' kv weighted by a per-channel softmax of their gates,
    no positional bias; ratio 1: the norm of each token's kv."""
    torch.manual_seed(0)
    x = torch.randn(6, 16)
    for rate in (1, 2):
        comp = Compressor(16, 8, rate, False, 1e-6, biased=False)
        with torch.no_grad():
            for p in comp.parameters():
                p.normal_()
        cfg = ModelConfig.from_dict({"text_config": {**TINY_TEXT_CONFIG, "engram_layer_ids": []}})
        state = models.new_state(cfg, 1, 4, 4)
        handle = RequestState(slot=0, pages=[0, 1])
        batch = ForwardBatch.build(state, [(handle, list(range(6)))])
        entries = torch.zeros(8, 8)
        ring = torch.zeros(1, 4, 16) if rate > 1 else None
        rotary = type("R", (), {"cos_sin": lambda self, pos, dtype: (torch.ones(len(pos), 2), torch.zeros(len(pos), 2))})()
        latent = comp.update(x, batch.plans[rate], ring, entries, rotary)
        kv = x @ comp.kv_proj.weight.T
        if rate == 1:
            pooled = kv
        else:
            gate = (x @ comp.gate_proj.weight.T).view(3, 2, 8).softmax(dim=1)
            pooled = (kv.view(3, 2, 8) * gate).sum(dim=1)
        want = pooled * torch.rsqrt(pooled.square().mean(-1, keepdim=True) + 1e-6) * comp.kv_norm.weight
        torch.testing.assert_close(latent, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(entries[:len(want)], want, atol=1e-5, rtol=1e-5)  # identity rope here


def test_candidate_blocks_keep_the_best_and_the_newest():
    inf = float("inf")
    scores = torch.tensor([[5., 1., 0., 0., 3., 3., 2., -inf],  # blocks of 2: 5, 0, 3, 2 (newest, partial)
                           [0., 0., 0., 0., 0., 0., -inf, -inf]])  # all tie: the lowest blocks, the newest kept
    visible = scores > -inf
    got = candidate_blocks(scores, visible, topk_blocks=2, block=2)
    assert got[0].tolist() == [True, True, False, False, False, False, True, False]  # best + newest
    assert got[1].tolist() == [True, True, False, False, True, True, False, False]  # lowest, then the newest
    # nothing visible yet: nothing eligible (and no NaN)
    none = candidate_blocks(torch.full((1, 4), -inf), torch.zeros(1, 4, dtype=torch.bool), 2, 2)
    assert not none.any()


def test_indexer_ties_keep_the_lowest_entry():
    """DESIGN's tie rule: among equal scores the lowest entry index wins, whatever the batch."""
    scores = torch.tensor([[0., 2., 0., 0., 2., -float("inf"), 0.]])
    order, valid = top_entries(scores, 4)
    assert order.tolist() == [[1, 4, 0, 2]] and valid.all()


# ---- config and checkpoint errors --------------------------------------------------------------------

@pytest.mark.parametrize("change,match", [
    ({"kv_source_layer_ids": [0, 2, 4, 5]}, "compress ratio is 0"),
    ({"compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1]}, "compress_ratios has 8 entries"),
    ({"engram_num_embeddings": [384, 553]}, "does not add up"),
    ({"index_source_layer_ids": [2, 5, 7]}, "no index source"),
    ({"kv_source_layer_ids": [2, 4]}, "no KV source of the same ratio"),
    ({"candidate_source_layer_id": 6}, "must be an index source"),
    ({"compress_ratios": [0, 0, 2, 2, 2, 1, 1, 3, 0, 0, 0]}, "values \\[3\\] are not supported"),
    ({"gate_temp": 2.0}, "gate_temp"),
    ({"norm_topk_prob": False}, "norm_topk_prob"),
    ({"dspark_num_experts_per_tok": 5}, "exceeds dspark_n_routed_experts=4"),
    ({"dspark_noise_token_id": 600}, "dspark_noise_token_id=600 is not a token id"),
    ({"dspark_target_layer_ids": [7, 6]}, "dspark_target_layer_ids"),
])
def test_inconsistent_configs_fail_naming_the_field(v41_checkpoint, change, match):
    raw = json.loads((v41_checkpoint / "config.json").read_text())
    raw["text_config"].update(change)
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict(raw)


def test_deepseek_inference_names_read_as_the_published_config(v41_checkpoint):
    raw = json.loads((v41_checkpoint / "config.json").read_text())
    text = raw["text_config"]
    names = {"dim": "hidden_size", "n_layers": "num_hidden_layers", "n_mtp_layers": "num_nextn_predict_layers",
             "n_heads": "num_attention_heads", "moe_inter_dim": "moe_intermediate_size",
             "n_activated_experts": "num_experts_per_tok", "score_func": "scoring_func",
             "route_scale": "routed_scaling_factor", "rope_head_dim": "qk_rope_head_dim", "norm_eps": "rms_norm_eps",
             "window_size": "sliding_window", "kv_source_layers": "kv_source_layer_ids",
             "index_source_layers": "index_source_layer_ids", "candidate_source_layer": "candidate_source_layer_id",
             "engram_pad_id": "engram_pad_token_id"}
    inference = {theirs: text[ours] for theirs, ours in names.items()}
    inference.update({k: v for k, v in text.items() if k not in names.values() and k != "rope_scaling"})
    scaling = text["rope_scaling"]
    inference.update(original_seq_len=scaling["original_max_position_embeddings"], rope_factor=scaling["factor"],
                     beta_fast=scaling["beta_fast"], beta_slow=scaling["beta_slow"], dtype="fp8", expert_dtype="fp4",
                     eos_token_id=1, image_token_id=raw["image_token_id"])
    inference.pop("model_type", None)
    got = ModelConfig.from_dict(inference)
    want = read_config(v41_checkpoint)
    assert got == ModelConfig.from_dict({**raw, "torch_dtype": "bfloat16"}) and got.dtype == "bfloat16"
    assert got.quantization == want.quantization and got.compress_rope == want.compress_rope


@pytest.fixture
def copy_of(v41_checkpoint, tmp_path):
    def copy():
        out = tmp_path / "ckpt"
        shutil.copytree(v41_checkpoint, out)
        return out
    return copy


def _edit_shard(path, edit):
    shard = sorted(path.glob("model-*.safetensors"))[0]
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    index["weight_map"] = {**{k: v for k, v in index["weight_map"].items() if k in tensors or
                              index["weight_map"][k] != shard.name},
                           **{k: shard.name for k in tensors}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def test_an_unknown_tensor_fails_the_load_naming_it(copy_of):
    path = copy_of()
    _edit_shard(path, lambda t: t.update({"layers.0.attn.w_new.weight": torch.zeros(2, 2)}))
    with pytest.raises(CheckpointError, match="layers.0.attn.w_new.weight"):
        load_model(path)


def test_a_missing_engram_table_fails_the_load_naming_it(copy_of):
    path = copy_of()
    shard = next(p for p in sorted(path.glob("model-*.safetensors"))
                 if "layers.1.engram.embed.weight" in load_file(p))
    tensors = load_file(shard)
    del tensors["layers.1.engram.embed.scale"]
    save_file(tensors, shard)
    with pytest.raises(CheckpointError, match="layers.1.engram.embed.scale"):
        load_model(path)


def test_a_tokenizer_of_another_checkpoint_fails_the_load(copy_of):
    path = copy_of()
    train_byte_bpe(512, ["another corpus entirely, with other merges " * 40]).save(str(path / "tokenizer.json"))
    with pytest.raises(ConfigError, match="engram_compressed_vocab_size"):
        load_model(path)


def test_the_load_skips_what_text_serving_does_not_read_and_maps_the_tables(model, v41_checkpoint):
    index = json.loads((v41_checkpoint / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(n.startswith("vision.") for n in index) and any(n.startswith("mtp.0.") for n in index)
    assert any(n.endswith(".bias_vl") for n in index) and "image_newline" in index
    names = set(model.state_dict())
    assert not any("vision" in n or "bias_vl" in n or "engram.embed" in n for n in names)
    assert any(n.startswith("mtp.2.markov_head.") for n in names)  # the DSpark stages load
    # the tables are the files' pages (mapped), not copies: their memory lies in a mapping of a shard
    maps = [line.split() for line in open("/proc/self/maps") if ".safetensors" in line]
    spans = [tuple(int(x, 16) for x in fields[0].split("-")) for fields in maps]
    for table in model.engram_tables:
        assert table.codes.dtype == torch.float8_e4m3fn and table.scales.dtype == torch.float8_e8m0fnu
        ptr = table.codes.data_ptr()
        assert any(lo <= ptr < hi for lo, hi in spans)


def test_a_bf16_engram_lookup_is_the_fp32_one_rounded():
    """Dequantizing in bf16 is exact: an FP8 code's 3 mantissa bits times a power-of-two scale."""
    from rackserve.models.deepseek_v41.engram import EngramTable

    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 256, (500, 64), dtype=torch.uint8, generator=gen)
    codes[(codes & 0x7F) == 0x7F] = 0  # the NaN codes
    scales = torch.randint(100, 150, (500, 2), dtype=torch.uint8, generator=gen).view(torch.float8_e8m0fnu)
    table = EngramTable(codes.view(torch.float8_e4m3fn), scales)
    rows = torch.randint(0, 500, (30, 7), generator=gen)
    assert torch.equal(table.lookup(rows, torch.bfloat16), table.lookup(rows, torch.float32).to(torch.bfloat16))
