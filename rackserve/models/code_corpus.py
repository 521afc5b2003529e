"""The text `tiny-code` is trained on: the Python standard library's own source files.

Every machine with Python has them without a download. Found through `sysconfig`, tests left out,
taken in sorted path order; every `HELD_OUT_EVERY`-th file is held out (never trained on), for
measuring the model and for prompts of benchmarks. The files are this interpreter's: another Python
version gives a slightly different corpus (the shipped model was trained on 3.11's).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

from rackserve.models.tokenizer import Tokenizer

HELD_OUT_EVERY = 20


def corpus() -> tuple[list[str], list[str], dict]:
    """(training texts, held-out texts, a description: where, how many files and characters)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "test", "tests", "idle_test"}
    files = sorted(p for p in root.rglob("*.py") if not skip & set(p.relative_to(root).parts))
    texts = [p.read_text(encoding="utf-8", errors="replace") for p in files]
    train = [t for i, t in enumerate(texts) if i % HELD_OUT_EVERY]
    held = [t for i, t in enumerate(texts) if i % HELD_OUT_EVERY == 0]
    info = {"root": str(root), "files": len(files), "train_files": len(train), "held_out_files": len(held),
            "train_chars": sum(map(len, train)), "held_out_chars": sum(map(len, held))}
    return train, held, info


def token_stream(tok: Tokenizer, texts: list[str]) -> list[int]:
    """Every text as BOS + its tokens + EOS, concatenated."""
    ids = []
    for text in texts:
        ids += [tok.bos_id, *tok.encode(text, add_bos=False), tok.eos_id]
    return ids


def held_out_prompts(n: int, chars: int = 200) -> list[str]:
    """`n` prompts of real code: the first `chars` characters of held-out files (cut at a line end),
    files with fewer skipped; cycles through the files when `n` is larger."""
    _, held, _ = corpus()
    heads = [t[:chars].rsplit("\n", 1)[0] + "\n" for t in held if len(t) > chars]
    return [heads[i % len(heads)] for i in range(n)]
