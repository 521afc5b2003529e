"""Train `tiny-code`: a small DeepSeek-V4 model of Python source, shipped with rackserve.

    .venv/bin/python tools/train_tiny_code.py [--minutes 35] [--mtp-minutes 12] [--out DIR]

Corpus: the Python standard library's own source files (`rackserve.models.code_corpus`: found
through `sysconfig`, tests left out, sorted; every 20th file held out). Tokenizer: byte-level BPE of 4096 ids
trained on the training files (`rackserve.models.tokenizer.train_byte_bpe`). Model: the V4
architecture with every feature the runtime serves (sliding, CSA and HCA layers; hash routing in
the first MoE layer, learned top-2 of 16 experts in the others, with DeepSeek's bias-based load
balancing; mHC streams; one MTP layer), trained with `transformers.DeepseekV4ForCausalLM` for
`--minutes`, then its MTP layer for `--mtp-minutes` against the frozen main model, built from
transformers' own layer classes (transformers does not train or load `mtp.*`). Seeded; prints the
corpus, the unigram entropy of the held-out tokens, and held-out loss and top-1 accuracy of the
main model and of the MTP layer, and writes them with the checkpoint (`training.json`).

Writes config.json, model.safetensors (bf16: the main model as transformers saves it, and the MTP
layer's `mtp.0.*`), the tokenizer files and training.json into `--out` (default: the built-in
`tiny-code` directory of the package).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
    DeepseekV4DecoderLayer,
    DeepseekV4HyperHead,
    DeepseekV4RMSNorm,
    DeepseekV4TopKRouter,
)

from rackserve.models.code_corpus import corpus, token_stream
from rackserve.models.deepseek_v4.config import CSA, HCA, SLIDING
from rackserve.models.deepseek_v4.tiny import CODE_DIR
from rackserve.models.tokenizer import Tokenizer, save_tokenizer, train_byte_bpe

SEED = 0
VOCAB = 4096
SEQ = 256  # tokens per training sequence
BATCH = 16  # sequences per step
CONFIG = {
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 32,
    "q_lora_rank": 64,
    "partial_rotary_factor": 0.25,
    "num_experts_per_tok": 2,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "routed_scaling_factor": 1.5,
    "layer_types": [SLIDING, CSA, HCA, CSA],
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    "compress_rates": {CSA: 4, HCA: 16},
    "sliding_window": 64,
    "o_groups": 2,
    "o_lora_rank": 32,
    "index_n_heads": 2,
    "index_head_dim": 32,
    "index_topk": 16,
    "num_nextn_predict_layers": 1,
    # trained on short windows, served to agents' long sessions: its attention is a 64-token window plus
    # compressed entries and its rotary positions are plain, so a long context is a memory question, not a
    # position one (an agentic trace's prompts start at ~9K tokens)
    "max_position_embeddings": 131072,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "tie_word_embeddings": False,
}
PEAK_LR = 3e-3
BIAS_STEP = 1e-3  # DeepSeek's auxiliary-loss-free balancing: each step, under-loaded experts' bias rises by this


def batches(stream: torch.Tensor, n: int, g: torch.Generator) -> torch.Tensor:
    """`n` windows of SEQ + 1 tokens at random offsets: `[n, SEQ + 1]`."""
    starts = torch.randint(0, len(stream) - SEQ - 1, (n,), generator=g)
    return torch.stack([stream[s:s + SEQ + 1] for s in starts.tolist()])


def held_out_windows(stream: torch.Tensor, limit: int) -> torch.Tensor:
    """Consecutive windows of SEQ + 1 tokens over the held-out stream (at most `limit`)."""
    n = min(limit, (len(stream) - 1) // SEQ)
    return torch.stack([stream[i * SEQ:i * SEQ + SEQ + 1] for i in range(n)])


def unigram_entropy(train: torch.Tensor, held: torch.Tensor) -> float:
    """Cross-entropy (nats/token) of the held-out tokens under the training tokens' unigram
    distribution (add-one smoothed): what a model that ignores context scores."""
    counts = torch.bincount(train, minlength=VOCAB).double() + 1
    logp = (counts / counts.sum()).log()
    return float(-logp[held].mean())


def lr_at(step: int, total: int, peak: float, warmup: int = 50) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    return peak * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / max(1, total - warmup))))


class BiasBalancer:
    """DeepSeek-V3/V4's auxiliary-loss-free load balancing of the learned routers: after each step, an
    expert chosen less often than the mean gets its correction bias raised by BIAS_STEP, one chosen
    more often lowered (the bias only picks experts; it does not weight them)."""

    def __init__(self, model: nn.Module):
        self.routers = [m for m in model.modules() if isinstance(m, DeepseekV4TopKRouter)]
        self.counts = [torch.zeros(r.num_experts) for r in self.routers]
        for router, counts in zip(self.routers, self.counts):
            router.register_forward_hook(self._hook(counts))

    @staticmethod
    def _hook(counts: torch.Tensor):
        def hook(module, args, output):
            counts.add_(torch.bincount(output[2].flatten(), minlength=len(counts)).float())
        return hook

    def update(self) -> None:
        with torch.no_grad():
            for router, counts in zip(self.routers, self.counts):
                router.e_score_correction_bias += BIAS_STEP * torch.sign(counts.mean() - counts)
                counts.zero_()


class MTPLayer(DeepseekV4DecoderLayer):
    """The MTP block as the runtime serves it (`rackserve.models.deepseek_v4.mtp`), from transformers'
    classes: for position i, x = e_proj(enorm(embed(t_{i+1}))) + h_proj(hnorm(h_i)) over the streams,
    one decoder layer (sliding attention, learned routing) at position i, then the head's collapse,
    norm and the shared lm_head predict t_{i+2}. Parameter names are the checkpoint's `mtp.0.*`."""

    def __init__(self, config: DeepseekV4Config):
        layer = config.num_hidden_layers
        extended = copy.deepcopy(config)
        extended.num_hidden_layers = layer + 1
        extended.layer_types = [*config.layer_types, SLIDING]
        extended.mlp_layer_types = [*config.mlp_layer_types, "moe"]
        super().__init__(extended, layer)
        d = config.hidden_size
        self.enorm = DeepseekV4RMSNorm(d, eps=config.rms_norm_eps)
        self.hnorm = DeepseekV4RMSNorm(d, eps=config.rms_norm_eps)
        self.e_proj = nn.Linear(d, d, bias=False)
        self.h_proj = nn.Linear(d, d, bias=False)
        self.norm = DeepseekV4RMSNorm(d, eps=config.rms_norm_eps)
        self.hc_head = DeepseekV4HyperHead(config)

    def logits(self, main: DeepseekV4ForCausalLM, streams: torch.Tensor, ids: torch.Tensor,
               extras: dict) -> torch.Tensor:
        """streams `[B, S, hc, D]`: the main model's final streams at positions 0 … S-1; ids `[B, S]`:
        the tokens at 1 … S -> logits `[B, S, vocab]` for the tokens at 2 … S+1."""
        x = self.e_proj(self.enorm(main.model.embed_tokens(ids))).unsqueeze(2) + self.h_proj(self.hnorm(streams))
        out = super().forward(x, input_ids=ids, **extras)
        return main.lm_head(self.norm(self.hc_head(out)))


def main_streams(main: DeepseekV4ForCausalLM, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The main model over ids `[B, S]`: (logits, final streams `[B, S, hc, D]`, the per-layer extras
    (rope, mask, positions) its layers got, for the MTP layer to run at the same positions)."""
    seen = {}

    def grab(module, args, kwargs, output):
        seen["streams"] = output
        seen["extras"] = {k: kwargs[k] for k in ("position_embeddings", "position_ids", "attention_mask")}

    handle = main.model.layers[-1].register_forward_hook(grab, with_kwargs=True)
    try:
        logits = main(input_ids=ids).logits
    finally:
        handle.remove()
    return logits, seen["streams"], seen["extras"]


def evaluate(main: DeepseekV4ForCausalLM, mtp: MTPLayer | None, windows: torch.Tensor) -> dict:
    """Held-out loss (nats/token) and top-1 accuracy of the main model, and of the MTP layer."""
    sums = {"loss": 0.0, "top1": 0.0, "mtp_loss": 0.0, "mtp_top1": 0.0}
    n = m = 0
    with torch.no_grad():
        for chunk in windows.split(BATCH):
            inp, tgt = chunk[:, :-1], chunk[:, 1:]
            logits, streams, extras = main_streams(main, inp)
            sums["loss"] += float(F.cross_entropy(logits.flatten(0, 1).float(), tgt.flatten(), reduction="sum"))
            sums["top1"] += float((logits.argmax(-1) == tgt).sum())
            n += tgt.numel()
            if mtp is not None:
                mlog = mtp.logits(main, streams[:, :-1], tgt[:, :-1], _trim(extras, SEQ - 1))
                sums["mtp_loss"] += float(F.cross_entropy(mlog.flatten(0, 1).float(), tgt[:, 1:].flatten(),
                                                          reduction="sum"))
                sums["mtp_top1"] += float((mlog.argmax(-1) == tgt[:, 1:]).sum())
                m += tgt[:, 1:].numel()
    out = {"loss": sums["loss"] / n, "top1": sums["top1"] / n}
    if mtp is not None:
        out |= {"mtp_loss": sums["mtp_loss"] / m, "mtp_top1": sums["mtp_top1"] / m}
    return out


def _trim(extras: dict, s: int) -> dict:
    """The layer extras of a sequence cut to its first `s` positions."""
    rope = {k: tuple(t[:, :s] for t in v) for k, v in extras["position_embeddings"].items()}
    return {"position_embeddings": rope, "position_ids": extras["position_ids"][:, :s],
            "attention_mask": extras["attention_mask"][..., :s, :s] if extras["attention_mask"] is not None else None}


def train(module: nn.Module, loss_of, stream: torch.Tensor, seconds: float, g: torch.Generator, tag: str) -> int:
    """Train `module`'s parameters for `seconds` on random windows of `stream`: AdamW, warm-up then a
    cosine schedule whose length is set from the speed of the first 20 steps, the learned routers'
    bias balancing after each step. `loss_of(windows [BATCH, SEQ + 1])` -> loss. Returns the steps run."""
    balancer = BiasBalancer(module)
    params = [p for p in module.parameters() if p.requires_grad and p.is_floating_point()]
    opt = torch.optim.AdamW(params, lr=PEAK_LR, betas=(0.9, 0.95), weight_decay=0.1)
    start, step, total = time.time(), 0, 10**9
    while time.time() - start < seconds:
        if step == 20:
            total = int(seconds / ((time.time() - start) / 20))
        for group in opt.param_groups:
            group["lr"] = lr_at(step, total, PEAK_LR)
        loss = loss_of(batches(stream, BATCH, g))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        balancer.update()
        if step % 50 == 0:
            print(f"  {tag} step {step}/{total if step >= 20 else '?'}: loss {loss.item():.3f}", flush=True)
        step += 1
    return step


def mtp_loss(main: DeepseekV4ForCausalLM, mtp: MTPLayer, windows: torch.Tensor) -> torch.Tensor:
    """The MTP layer's loss on `windows` `[B, SEQ + 1]` (predicting each token two ahead), the main
    model frozen."""
    inp, tgt = windows[:, :-1], windows[:, 1:]
    with torch.no_grad():
        _, streams, extras = main_streams(main, inp)
    logits = mtp.logits(main, streams[:, :-1], tgt[:, :-1], _trim(extras, SEQ - 1))
    return F.cross_entropy(logits.flatten(0, 1).float(), tgt[:, 1:].flatten())


def init_mtp(main: DeepseekV4ForCausalLM) -> MTPLayer:
    """The MTP layer, started from the main model's last learned-routing layer (its attention becomes
    a sliding one: the compressor and indexer weights are not kept), projections near identity."""
    mtp = MTPLayer(main.config)
    mtp.apply(main._init_weights)
    source = main.model.layers[-1].state_dict()
    mine = mtp.state_dict()
    mtp.load_state_dict({k: (source[k] if k in source and source[k].shape == v.shape else v)
                         for k, v in mine.items()})
    with torch.no_grad():
        for proj in (mtp.e_proj, mtp.h_proj):
            proj.weight.copy_(torch.eye(proj.weight.shape[0]) * 0.5)
        mtp.enorm.weight.fill_(1.0)
        mtp.hnorm.weight.fill_(1.0)
        mtp.norm.weight.copy_(main.model.norm.weight)
        mtp.hc_head.load_state_dict(main.model.hc_head.state_dict())
    return mtp


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=35.0)
    parser.add_argument("--mtp-minutes", type=float, default=12.0)
    parser.add_argument("--out", type=Path, default=CODE_DIR)
    args = parser.parse_args(argv)
    torch.manual_seed(SEED)
    g = torch.Generator().manual_seed(SEED)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    train_texts, held_texts, info = corpus()
    print(f"corpus: {info}", flush=True)
    save_tokenizer(train_byte_bpe(VOCAB, train_texts), out)
    tok = Tokenizer(out)
    train_stream = torch.tensor(token_stream(tok, train_texts))
    held_stream = torch.tensor(token_stream(tok, held_texts))
    info |= {"train_tokens": len(train_stream), "held_out_tokens": len(held_stream)}
    entropy = unigram_entropy(train_stream, held_stream)
    print(f"tokens: train {len(train_stream):,}, held out {len(held_stream):,}; "
          f"unigram cross-entropy of held-out {entropy:.3f} nats/token", flush=True)

    config = DeepseekV4Config(**CONFIG)
    model = DeepseekV4ForCausalLM(config).float()
    with torch.no_grad():  # the hash layer's frozen token -> experts table: distinct experts per token
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):
                gate.tid2eid.copy_(torch.argsort(torch.rand(VOCAB, config.n_routed_experts, generator=g),
                                                 dim=1)[:, :config.num_experts_per_tok])
    held = held_out_windows(held_stream, 64)
    t0 = time.time()
    # transformers shifts the labels: each window's tokens predict their successors
    steps = train(model.train(), lambda w: model(input_ids=w, labels=w).loss, train_stream, args.minutes * 60, g,
                  "main")
    model.eval()
    main_eval = evaluate(model, None, held)
    print(f"main: {steps} steps in {time.time() - t0:.0f} s; held-out {main_eval}", flush=True)

    mtp = init_mtp(model)
    t0 = time.time()
    model.requires_grad_(False)
    mtp_steps = train(mtp.train(), lambda w: mtp_loss(model, mtp, w), train_stream, args.mtp_minutes * 60, g, "mtp")
    mtp.eval()
    final = evaluate(model, mtp, held)
    print(f"mtp: {mtp_steps} steps in {time.time() - t0:.0f} s; held-out {final}", flush=True)

    model.to(torch.bfloat16).save_pretrained(out)
    # the MTP layer joins the same file under its `mtp.0.*` names, as DeepSeek ships it
    weights = load_file(str(out / "model.safetensors"))
    weights |= {f"mtp.0.{k}": v.to(torch.bfloat16).contiguous() for k, v in mtp.state_dict().items()}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    # served and compared in fp32: the weights are stored in bf16 (half the bytes) and widened at load
    cfg = json.loads((out / "config.json").read_text())
    cfg["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    record = {"seed": SEED, "corpus": info, "unigram_cross_entropy": entropy, "main_steps": steps,
              "mtp_steps": mtp_steps, "batch_tokens": BATCH * SEQ, "held_out": final,
              "torch": torch.__version__}
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
