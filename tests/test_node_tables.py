"""A node's one copy of the tiny V4.1's Engram tables (`rackserve.models.node_tables`): published from the
checkpoint's files as stored, mapped shared by every process that asks (one copy, counted by the
kernel's maps), equal to the tables read from the files (the model's logits too), never seen half
written, refused with the numbers when the file system is too small, named by node and checkpoint, and
swept once its owner is gone. The Ray side (one host per node, ranks restarting onto the same pages) is
in `test_node_tables_ray.py`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from helpers import new_state, prompt, step

from rackserve.config import ConfigError, EngineConfig
from rackserve.models import host_tables, load_model, resolve
from rackserve.models.checkpoint import CheckpointError
from rackserve.models.deepseek_v41.config import ModelConfig
from rackserve.models.node_tables import NodeTables, mappers, sweep

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def tables(v41_checkpoint, tmp_path) -> NodeTables:
    return NodeTables(str(tmp_path), "node-a" * 8, tuple(host_tables(v41_checkpoint)))


def test_only_v41_has_host_tables_and_they_are_its_engram_codes_and_scales(v41_checkpoint):
    entries = host_tables(v41_checkpoint)
    config = ModelConfig.from_pretrained(v41_checkpoint)
    assert [e.name for e in entries] == [f"layers.{n}.engram.embed.{s}" for n in config.engram_layer_ids
                                         for s in ("weight", "scale")]
    assert sum(e.shape[0] * e.shape[1] * e.dtype.itemsize for e in entries) == config.host_table_bytes
    assert host_tables(resolve("tiny")) == []


@pytest.mark.parametrize("huge_pages", [False, True], ids=["4k", "huge"])
def test_the_published_set_is_the_files_tables_shared_not_copied(v41_checkpoint, tables, huge_pages):
    lasts = tables.publish(huge_pages)
    assert lasts >= 0 and tables.exists() and (tables.directory / "owner").read_text() == str(os.getpid())
    mapped = tables.map(huge_pages)
    from_files = load_model(v41_checkpoint).engram_tables
    for table, (codes, scales) in zip(from_files, zip(*[iter(mapped.values())] * 2)):
        assert codes.dtype == torch.float8_e4m3fn and scales.dtype == torch.float8_e8m0fnu
        assert torch.equal(codes.view(torch.uint8), table.codes.view(torch.uint8))
        assert torch.equal(scales.view(torch.uint8), table.scales.view(torch.uint8))
    # the kernel says this process maps the set: its files, not a private copy
    assert mappers(tables.directory) == [os.getpid()]
    maps = Path("/proc/self/maps").read_text().splitlines()
    assert sum(str(tables.directory) in line for line in maps) >= len(tables.tensors)


def test_a_model_on_the_shared_tables_computes_what_one_on_the_files_does(v41_checkpoint, tables):
    tables.publish()
    shared = load_model(v41_checkpoint, host_tensors=tables.map())
    files = load_model(v41_checkpoint)
    ids = prompt(24, seed=3)
    logits = []
    for model in (shared, files):
        cache = new_state(model)
        with torch.no_grad():
            logits.append(step(model, cache, [(cache.allocate(), ids)], all_logits=True))
    assert torch.equal(*logits)  # the same rows, the same computation


def test_tables_from_another_checkpoint_are_refused(v41_checkpoint, tables):
    tables.publish()
    mapped = tables.map()
    mapped.pop(next(iter(mapped)))
    with pytest.raises(CheckpointError, match="lack .*engram.embed.weight.*another checkpoint"):
        load_model(v41_checkpoint, host_tensors=mapped)


def test_a_file_system_without_room_is_refused_naming_the_numbers_and_the_fix(tables, monkeypatch):
    small = shutil.disk_usage(tables.root)._replace(free=tables.nbytes - 1)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: small)
    with pytest.raises(ConfigError, match=r"GiB free; the node's host tables need .* GiB: enlarge it .*--shm-size"):
        tables.publish()
    assert not any(Path(tables.root).iterdir())  # nothing left behind


def test_a_copy_that_fails_midway_leaves_no_set_and_no_partial(v41_checkpoint, tables, tmp_path):
    # the last table's file ends inside it: what came before it is copied, then the copy fails
    broken = tmp_path / "broken"
    shutil.copytree(v41_checkpoint, broken)
    last = tables.tensors[-1]
    data = last.file.read_bytes()
    header = 8 + int.from_bytes(data[:8], "little")
    start = json.loads(data[8:header])[last.name]["data_offsets"][0]
    (broken / last.file.name).write_bytes(data[:header + start + 8])
    entries = tuple(replace(t, file=broken / t.file.name) for t in tables.tensors)
    half = NodeTables(str(tmp_path / "shm"), tables.node, entries)
    (tmp_path / "shm").mkdir()
    with pytest.raises(CheckpointError, match=r"ended inside layers\.\d\.engram\.embed\.\w+: the file is truncated"):
        half.publish()
    assert not half.exists() and list((tmp_path / "shm").iterdir()) == []


def test_a_set_is_named_by_its_node_its_root_and_its_files(tables, v41_checkpoint, tmp_path_factory):
    other_node = NodeTables(tables.root, "node-b" * 8, tables.tensors)
    assert other_node.directory != tables.directory
    # the name is also its host actor's: a set of the same tables under another root is another one
    other_root = NodeTables(str(tmp_path_factory.mktemp("shm")), tables.node, tables.tensors)
    assert other_root.directory.name != tables.directory.name
    assert NodeTables(tables.root, tables.node, tables.tensors).directory == tables.directory
    first, named = tables.tensors[0].file, tables.directory
    stat = first.stat()
    try:
        os.utime(first, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the checkpoint's file changed
        assert NodeTables(tables.root, tables.node, tables.tensors).directory != named
    finally:
        os.utime(first, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_sweep_removes_what_dead_owners_left_and_keeps_the_rest(tables):
    tables.publish()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    dead_pid = gone.stdout.strip()
    dead = Path(tables.root) / "rackserve-tables-deadnode-0123"
    dead.mkdir()
    (dead / "owner").write_text(dead_pid)
    partial = Path(tables.root) / f".rackserve-tables-x.partial-{dead_pid}"
    partial.mkdir()
    live_partial = Path(tables.root) / f".rackserve-tables-y.partial-{os.getpid()}"
    live_partial.mkdir()
    unrelated = Path(tables.root) / "someone-else"
    unrelated.mkdir()
    assert sorted(sweep(tables.root)) == sorted([dead, partial])
    assert tables.exists() and live_partial.is_dir() and unrelated.is_dir()
    # a set whose owner died is kept when asked for (a restarted owner adopts it)
    (tables.directory / "owner").write_text(dead_pid)
    assert sweep(tables.root, keep=tables.directory) == [] and tables.exists()
    tables.adopt()
    assert (tables.directory / "owner").read_text() == str(os.getpid())


@pytest.mark.parametrize("kwargs,match", [
    ({"table_dir": "dev/shm"}, "table_dir='dev/shm' must be an absolute path"),
    ({"table_huge_pages": "yes"}, "table_huge_pages='yes' must be true or false"),
])
def test_table_settings_are_checked(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**kwargs)
