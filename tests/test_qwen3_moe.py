"""The Qwen3-MoE family, on a tiny checkpoint written by transformers itself: its logits equal
`transformers.Qwen3MoeForCausalLM`'s for ragged one-shot prefill, chunked prefill and cached decode
with requests joining mid-way; `rackserve.LLM` gives transformers' greedy `generate` outputs; the
prefix cache serves a shared prefix; fused, sharded and expert-parallel loads read the same weights;
what is not supported fails naming the fix. On Ray: a P/D deployment, the OpenAI endpoint and a DEP2
instance with EPLB give the single-process engine's outputs."""

from __future__ import annotations

import functools
import json
import shutil
import time
from types import SimpleNamespace

import pytest
import torch
from helpers import assert_same_tokens, prompt, settled_stats
from safetensors.torch import load_file, save_file
from test_graphs import assert_one_graph, assert_same_outputs, fixed_shape_batches

from rackserve.config import ConfigError, EngineConfig
from rackserve.engine import LLM, SamplingParams
from rackserve.engine.graphs import _leaves
from rackserve.engine.state_cache import StateCache
from rackserve.models import read_config
from rackserve.models.interface import StaticShape
from rackserve.models.qwen3_moe import CheckpointError, ModelConfig, load_model
from rackserve.models.qwen3_moe.tiny import make_tiny
from rackserve.models.tokenizer import Tokenizer

TOL = 1e-4  # max |Δ logit| against the reference, fp32
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(qwen3_checkpoint):
    return qwen3_checkpoint


@pytest.fixture(scope="module")
def reference(checkpoint):
    from transformers import Qwen3MoeForCausalLM

    model = Qwen3MoeForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run to max_new_tokens, as ignore_eos does
    return model


@pytest.fixture(scope="module")
def ours(checkpoint):
    return load_model(checkpoint)


@torch.no_grad()
def reference_logits(reference, ids: list[int]) -> torch.Tensor:
    """The reference's logits `[len(ids), vocab]` for one sequence, in one forward."""
    return reference(torch.tensor([ids])).logits[0].float()


def run_schedule(model, seqs: list[list[int]], pieces: list[list[int]], joins: list[int],
                 block_size: int = 16) -> list[torch.Tensor]:
    """Feed request i its tokens `seqs[i]` in pieces of `pieces[i]` tokens, one piece per step from step
    `joins[i]` on, every active request in one forward per step; each request's logits of every token."""
    cache = StateCache(model.config, block_size, len(seqs), 16 << 20, prefix_caching=False, dtype=model.dtype)
    handles = [cache.allocate() for _ in seqs]
    queues, got = [list(p) for p in pieces], [[] for _ in seqs]
    step = 0
    while any(queues):
        active = [i for i, q in enumerate(queues) if q and step >= joins[i]]
        requests = []
        for i in active:
            start = handles[i].num_tokens
            requests.append((handles[i], seqs[i][start:start + queues[i].pop(0)]))
            assert cache.reserve(handles[i], start + len(requests[-1][1]))
        if requests:
            lens = [len(ids) for _, ids in requests]
            logits = model(model.build_batch(cache.state, requests, num_logits=lens), cache.state)
            for i, part, (handle, ids) in zip(active, logits.split(lens), requests):
                got[i].append(part)
                handle.num_tokens += len(ids)
        step += 1
    return [torch.cat(g) for g in got]


def max_diff(reference, seqs: list[list[int]], got: list[torch.Tensor]) -> float:
    return max(float((g - reference_logits(reference, s)).abs().max()) for s, g in zip(seqs, got))


def test_one_shot_ragged_prefill_equals_the_reference(ours, reference):
    seqs = [prompt(n, seed=n) for n in (1, 7, 33, 64, 100)]
    got = run_schedule(ours, seqs, [[len(s)] for s in seqs], [0] * len(seqs))
    assert max_diff(reference, seqs, got) < TOL


def test_tied_embeddings_load_and_equal_the_reference(tmp_path):
    """transformers writes no lm_head.weight for tied embeddings: the head is the embedding."""
    from transformers import Qwen3MoeForCausalLM

    path = make_tiny(tmp_path, seed=1, config={"tie_word_embeddings": True})
    assert "lm_head.weight" not in load_file(path / "model.safetensors")
    model = load_model(path)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    seqs = [prompt(n, seed=n) for n in (9, 30)]
    got = run_schedule(model, seqs, [[len(s)] for s in seqs], [0, 0])
    assert max_diff(Qwen3MoeForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), seqs, got) < TOL


def test_chunked_prefill_with_odd_chunks_equals_the_reference(ours, reference):
    """Chunks of 7, 13, 5, 11, … tokens over pages of 5 tokens: chunks straddle pages and start mid-page."""
    seqs = [prompt(n, seed=10 + n) for n in (61, 45, 30)]
    odd = [7, 13, 5, 11, 3, 9]
    pieces = []
    for s in seqs:
        sizes, left = [], len(s)
        while left:
            sizes.append(min(odd[len(sizes) % len(odd)], left))
            left -= sizes[-1]
        pieces.append(sizes)
    got = run_schedule(ours, seqs, pieces, [0, 1, 2], block_size=5)
    assert max_diff(reference, seqs, got) < TOL


def test_cached_decode_with_requests_joining_equals_the_reference(ours, reference):
    """A prompt, then one token a step for 30 steps; four requests joining at steps 0, 3, 9 and 17."""
    prompts = (12, 5, 20, 1)
    seqs = [prompt(n + 30, seed=20 + n) for n in prompts]
    got = run_schedule(ours, seqs, [[n] + [1] * 30 for n in prompts], [0, 3, 9, 17])
    assert max_diff(reference, seqs, got) < TOL


def assert_same_greedy(reference, prompts, got: list[list[int]], want: list[list[int]]) -> None:
    """`assert_same_tokens` with the transformers reference as the judge of near-ties."""
    assert_same_tokens(None, prompts, got, want, GREEDY, TOL, teacher=lambda ids: reference_logits(reference, ids))


PROMPTS = [prompt(n, seed=30 + n) for n in (5, 33, 70, 12, 41)]


@torch.no_grad()
def reference_greedy(reference, prompts, max_tokens: int) -> list[list[int]]:
    return [reference.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False)[0, len(p):].tolist()
            for p in prompts]


def test_llm_greedy_outputs_equal_transformers_generate(checkpoint, reference):
    """Five token prompts and one text prompt, batched with a small token budget (chunked prefills
    beside decodes)."""
    text = "The rack hums"
    llm = LLM(checkpoint, max_num_seqs=4, max_num_batched_tokens=32)
    completions = llm.generate([*PROMPTS, text], GREEDY)
    prompts = [*PROMPTS, Tokenizer(checkpoint).encode(text)]
    assert completions[-1].prompt_token_ids == prompts[-1]
    assert_same_greedy(reference, prompts, [c.token_ids for c in completions],
                       reference_greedy(reference, prompts, GREEDY.max_tokens))
    assert completions[-1].text == Tokenizer(checkpoint).decode(completions[-1].token_ids)


def test_a_shared_prefix_is_served_from_the_prefix_cache(checkpoint, reference):
    shared = prompt(70, seed=40)
    first, second = shared + prompt(5, seed=41), shared + prompt(9, seed=42)
    llm = LLM(checkpoint)
    llm.generate([first], GREEDY)
    [cached] = llm.generate([second], GREEDY)
    assert cached.num_cached_tokens == 64  # the shared prefix's full blocks of 16
    [plain] = LLM(checkpoint, prefix_caching=False).generate([second], GREEDY)
    assert plain.num_cached_tokens == 0
    assert_same_greedy(reference, [second], [cached.token_ids], [plain.token_ids])


# Qwen3-30B-A3B's config.json as Qwen publishes it (transformers 4.51: legacy names)
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144, "max_position_embeddings": 40960,
    "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe", "moe_intermediate_size": 768,
    "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False, "rms_norm_eps": 1e-06,
    "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
    "vocab_size": 151936,
}


def test_configs_as_published_and_as_transformers_5_writes_them(checkpoint):
    c = ModelConfig.from_dict(QWEN3_30B_A3B)
    assert (c.n_routed_experts, c.num_moe_layers, c.rope_theta, c.head_dim, c.dtype, c.eos_token_ids) == (
        128, 48, 1e6, 128, "bfloat16", (151645,))
    raw = json.loads((checkpoint / "config.json").read_text())
    assert "num_local_experts" in raw and "rope_parameters" in raw  # what transformers 5 writes
    tiny = read_config(checkpoint)  # dispatched on model_type
    assert isinstance(tiny, ModelConfig)
    assert (tiny.num_experts, tiny.num_moe_layers, tiny.num_hidden_layers, tiny.rope_theta) == (8, 3, 4, 1e6)


def test_stop_ids_of_generation_config_join_config_json(checkpoint, tmp_path):
    """Qwen lists `<|im_end|>` in config.json and `<|endoftext|>` too in generation_config.json: both stop."""
    copy = shutil.copytree(checkpoint, tmp_path / "ckpt")
    eos = read_config(copy).eos_token_ids
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [*eos, 7]}))
    assert read_config(copy).eos_token_ids == (*eos, 7)


@pytest.mark.parametrize("override, match", [
    ({"use_sliding_window": True}, "use_sliding_window=true .* set use_sliding_window to false"),
    ({"attention_bias": True}, "attention_bias=true is not supported"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, r"rope_scaling\.rope_type='yarn' .* rope_type to 'default'"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e6}}, r"rope_parameters\.rope_type='dynamic'"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization_config: .* serve the unquantized"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu' .* 'silu'"),
    ({"num_key_value_heads": 5}, "num_key_value_heads=5 must divide num_attention_heads=32"),
    ({"mlp_only_layers": [3, 48]}, r"mlp_only_layers has \[48\]"),
    ({"num_experts_per_tok": 129}, "num_experts_per_tok=129 exceeds num_experts=128"),
    ({"torch_dtype": "float64"}, "dtype='float64' is not supported"),
])
def test_unsupported_config_values_fail_naming_the_field_and_fix(override, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_dict({**QWEN3_30B_A3B, **override})


def test_speculation_and_quantized_state_fail_naming_the_fix(checkpoint):
    config = read_config(checkpoint)
    with pytest.raises(ConfigError, match="no draft model .* set speculative_tokens=0"):
        EngineConfig(speculative_tokens=1).resolve(config)
    with pytest.raises(ConfigError, match="set speculative_tokens=0"):
        LLM(checkpoint, speculative_tokens=2)
    with pytest.raises(ConfigError, match="state_dtype='fp8'.* set state_dtype='auto'"):
        LLM(checkpoint, state_dtype="fp8")


def test_the_padded_decode_forward_is_one_graph_whose_shapes_are_the_shapes_alone(checkpoint):
    llm = LLM(checkpoint, max_num_seqs=4, block_size=16, prefix_caching=False, compile="trace")
    shape, batch, other = fixed_shape_batches(llm, (5, 33, 70))
    assert shape == StaticShape(4, 8)  # 70 tokens + 1 in pages of 16 -> 5 pages -> bucket 8
    assert_one_graph(llm, batch)
    assert [t.shape for t in _leaves(batch)] == [t.shape for t in _leaves(other)]
    assert batch.real.tolist() == [True] * 3 + [False] and other.real.tolist() == [True] + [False] * 3


@pytest.mark.parametrize("mode", ["trace", pytest.param("on", marks=pytest.mark.slow)])
def test_decode_on_fixed_shapes_equals_eager(checkpoint, mode):
    """Ragged prompts across page boundaries, one of them sampled, requests finishing at different
    steps: the eager engine's tokens (near-ties judged), logprobs within 1e-5 where the tokens agree.
    "on" is the real compiler (inductor's C++), on pages of 128 tokens: two shapes to compile, not three."""
    prompts = [prompt(n, seed=400 + n) for n in (3, 17, 40, 64, 129, 200)]
    params = [SamplingParams(max_tokens=m, temperature=t, seed=5, ignore_eos=True, logprobs=2)
              for m, t in [(24, 0.0), (9, 0.0), (30, 0.0), (16, 0.8), (21, 0.0), (12, 0.0)]]
    kwargs = {"max_num_seqs": 8, "block_size": 16 if mode == "trace" else 128, "graph_buckets": (8,),
              "max_model_len": 256}
    want = LLM(checkpoint, **kwargs).generate(prompts, params)
    llm = LLM(checkpoint, compile=mode, **kwargs)
    got = llm.generate(prompts, params)
    graphs = llm.engine.runner.graphs
    assert graphs.failures == 0 and graphs.replays >= 29  # every decode step
    assert {s.tokens for _, s in graphs.shapes} == {8}
    assert_same_outputs(checkpoint, got, want, prompts=prompts, params=params)


def _rewrite(checkpoint, dest, edit) -> None:
    """Copy `checkpoint` into `dest` with its tensors passed through `edit` (dict -> dict of files' tensors)."""
    shutil.copytree(checkpoint, dest)
    (dest / "model.safetensors").unlink()
    for file, tensors in edit(load_file(checkpoint / "model.safetensors")).items():
        save_file(tensors, dest / file, metadata={"format": "pt"})


def test_fused_experts_in_shards_load_the_same_weights(checkpoint, ours, tmp_path):
    """The experts as transformers holds them in memory (gate_up `[E, 2I, D]`, down), over two shards."""
    def fuse(tensors):
        out = {}
        for layer in range(4):
            prefix = f"model.layers.{layer}.mlp.experts"
            per = {n: tensors.pop(n) for n in list(tensors) if n.startswith(prefix + ".")}
            if per:
                out[f"{prefix}.gate_up_proj"] = torch.stack(
                    [torch.cat([per[f"{prefix}.{e}.gate_proj.weight"], per[f"{prefix}.{e}.up_proj.weight"]])
                     for e in range(8)])
                out[f"{prefix}.down_proj"] = torch.stack([per[f"{prefix}.{e}.down_proj.weight"] for e in range(8)])
        files = {"model-00001-of-00002.safetensors": tensors, "model-00002-of-00002.safetensors": out}
        index = {"weight_map": {n: f for f, ts in files.items() for n in ts}}
        (tmp_path / "fused" / "model.safetensors.index.json").write_text(json.dumps(index))
        return files

    _rewrite(checkpoint, tmp_path / "fused", fuse)
    loaded = load_model(tmp_path / "fused").state_dict()
    assert all(torch.equal(t, loaded[n]) for n, t in ours.state_dict().items())


def test_a_mismatched_checkpoint_lists_what_is_wrong(checkpoint, tmp_path):
    def damage(tensors):
        del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
        del tensors["model.norm.weight"]
        tensors["model.layers.1.mlp.experts.0.gate_proj.weight"] = torch.zeros(32, 64)  # layer 1 is dense
        tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(48, 64)
        return {"model.safetensors": tensors}

    _rewrite(checkpoint, tmp_path / "bad", damage)
    with pytest.raises(CheckpointError) as err:
        load_model(tmp_path / "bad")
    message = str(err.value)
    assert "2 missing: model.layers.2.mlp.experts.5.up_proj.weight, model.norm.weight" in message
    assert "1 unexpected: model.layers.1.mlp.experts.0.gate_proj.weight" in message
    assert "1 wrong shape: model.layers.0.self_attn.k_proj.weight: checkpoint [48, 64] vs model [64, 64]" in message


def test_an_expert_parallel_load_reads_only_this_ranks_experts(checkpoint, ours):
    """Rank 1 of 2 with 10 slots (experts 0 and 3 replicated): its slots hold the full model's experts
    of its half of the layout, with the slot maps built on the real device."""
    layout = torch.stack([torch.cat([torch.randperm(8, generator=torch.Generator().manual_seed(layer)),
                                     torch.tensor([0, 3])]) for layer in range(3)])
    rank1 = SimpleNamespace(local_slots=range(5, 10))  # all that loading asks of the transport
    sharded = load_model(checkpoint, shard=(rank1, layout))
    for full, part, row in zip(ours.moe_layers, sharded.moe_layers, layout, strict=True):
        assert part.local_experts == row[5:].tolist()
        assert torch.equal(part.experts.gate_up_proj, full.experts.gate_up_proj[row[5:]])
        assert torch.equal(part.experts.down_proj, full.experts.down_proj[row[5:]])
        assert torch.equal(part.phy2log, row) and part.slot_load.device == part.gate.weight.device


# ---- on Ray ---------------------------------------------------------------------------------------

RAY_ENGINE = {"max_num_seqs": 4, "max_num_batched_tokens": 64}
RAY_PROMPTS = [prompt(n, seed=50 + n) for n in (5, 33, 70, 12, 41, 20)]


@functools.cache
def single_process(checkpoint) -> list[list[int]]:
    return [c.token_ids for c in LLM(checkpoint, **RAY_ENGINE).generate(RAY_PROMPTS, GREEDY)]


@pytest.mark.slow
def test_pd_deployment_equals_the_single_process_engine(ray_cluster, checkpoint, reference):
    """Prefill on a DEP1 instance, state pushed over NIXL to a DEP2 decode instance re-placing experts,
    with a KV store (a KV cache has no slot tensors: its prefix snapshots cost nothing); a conversation's
    next turn then reads its history from the store (the prefill rank keeps no prefix cache of its own here)."""
    import ray

    from rackserve.cluster.deployment import Deployment

    dep = Deployment(checkpoint, prefill="1xDEP1", decode="1xDEP2", kv_stores=1,
                     engine_kwargs={**RAY_ENGINE, "kv_timeout_s": 60.0}, timeout=10.0,
                     prefill_engine_kwargs={"prefix_caching": False}, decode_engine_kwargs={"eplb_interval": 2})
    try:
        got = [c.token_ids for c in dep.generate(RAY_PROMPTS, GREEDY)]
        assert_same_greedy(reference, RAY_PROMPTS, got, single_process(checkpoint))
        decode = [m for inst in dep.stats()["decode"] for m in inst["members"]]
        assert sum(m["kv_loaded"] for m in decode) == len(RAY_PROMPTS)  # every state was pushed
        turn2 = RAY_PROMPTS[2] + got[2] + [5, 6, 7]  # the store holds prompt + answer, written at the end
        deadline = time.monotonic() + 60
        while ray.get(dep.stores[0].lookup.remote(turn2)) is None:  # its decode rank writes it
            assert time.monotonic() < deadline, "the finished request never reached the store"
            time.sleep(0.1)
        [again] = dep.generate([turn2], GREEDY)
        [want] = LLM(checkpoint, **RAY_ENGINE).generate([turn2], GREEDY)
        assert_same_greedy(reference, [turn2], [again.token_ids], [want.token_ids])
        assert again.num_cached_tokens > 0
        # its prefix came from the store: the store hit it and the prefill rank read that many tokens
        [store] = dep.stats()["kv_stores"]
        prefill = [m for inst in dep.stats()["prefill"] for m in inst["members"]]
        assert store["hit_tokens"] >= again.num_cached_tokens
        assert sum(m["kv_pulled_tokens"] for m in prefill) == again.num_cached_tokens
    finally:
        dep.shutdown()


@pytest.mark.slow
def test_the_openai_endpoint_serves_the_checkpoint_directory(ray_cluster, checkpoint):
    """`rackserve serve`'s app (P/D, DEP1 each; no KV store, the P/D test has one) over real HTTP: one
    completion, the single-process engine's greedy text."""
    import httpx
    from helpers import free_port
    from ray import serve

    from rackserve.serve import ingress
    from rackserve.serve.app import build, delete

    port, name, text = free_port(), "rackserve-qwen3-moe", "The rack hums"
    settings = {"model": str(checkpoint), "served_model_name": "qwen3-moe-tiny", "prefill": "1xDEP1",
                "decode": "1xDEP1", "kv_stores": 0, "max_inflight": 8,
                "engine": {**RAY_ENGINE, "state_memory_mb": 16, "kv_pool_mb": 8}}
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build(settings), name=name, route_prefix="/")
        ingress.wait_until_serving(f"http://127.0.0.1:{port}")
        body = {"model": "qwen3-moe-tiny", "prompt": text, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=120).json()
    finally:
        delete(name)
        serve.shutdown()
    [want] = LLM(checkpoint).generate([text], GREEDY)
    assert reply["choices"][0]["text"] == want.text and reply["usage"]["completion_tokens"] == 12


@pytest.mark.slow
def test_dep2_instance_with_eplb_equals_the_single_process_engine(ray_cluster, checkpoint, reference):
    from rackserve.cluster.instance import Instance

    inst = Instance(checkpoint, dep=2, redundant_slots=2, engine_kwargs={**RAY_ENGINE, "eplb_interval": 2})
    try:
        got = [c.token_ids for c in inst.generate(RAY_PROMPTS, GREEDY)]
        assert_same_greedy(reference, RAY_PROMPTS, got, single_process(checkpoint))
        members = settled_stats(inst)["members"]
        assert members[0]["eplb_rebalances"] >= 1 and len({m["eplb_rebalances"] for m in members}) == 1
    finally:
        inst.shutdown()
