"""Shared fixtures: tiny checkpoints written once per test session and the session's Ray cluster, and
the process settings every test runs under. What tests import lives in `helpers.py`."""

from __future__ import annotations

import os

import pytest

# One intra-op thread here and in the processes the tests start (before torch loads OpenMP, which
# reads it once): the tiny model's ops gain nothing from a second thread (the model tests took 24 s
# with one, 25 s with two), and on a loaded machine OpenMP threads spinning at their barriers
# against other processes made them 13-25x slower. Ray's workers get one thread already.
os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Without a GPU the Triton kernels run under the interpreter, which triton picks once, when it is
    # first imported: switch it on before anything imports triton (auto dispatch still uses torch).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import GPUS_PER_TRAY, RACKS, REFERENCE_CONFIGS, TRAYS, free_ports  # noqa: E402

from rackserve.models import load_model  # noqa: E402
from rackserve.models.deepseek_v4.tiny import make_tiny  # noqa: E402


@pytest.fixture(scope="session", params=sorted(REFERENCE_CONFIGS))
def ref_checkpoint(request, tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp(request.param), seed=1, config=REFERENCE_CONFIGS[request.param])


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """The built-in tiny config as shipped (indexer top-k 8, smaller than long prompts' entry counts)."""
    return make_tiny(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="session")
def published_fp4(tmp_path_factory):
    """The tiny model as DeepSeek publishes V4: its names, shards, FP8 linears, FP4 routed experts, UE8M0 scales."""
    return make_tiny(tmp_path_factory.mktemp("published-fp4"), seed=0, fmt="published", quant="fp4")


@pytest.fixture(scope="session")
def v41_checkpoint(tmp_path_factory):
    """The tiny DeepSeek-V4.1 checkpoint, laid out as published (`rackserve make-tiny --family deepseek_v41`)."""
    from rackserve.models.deepseek_v41.tiny import make_tiny as make_tiny_v41

    return make_tiny_v41(tmp_path_factory.mktemp("v41"), seed=0)


@pytest.fixture(scope="session")
def qwen3_checkpoint(tmp_path_factory):
    """The tiny Qwen3-MoE checkpoint (`rackserve make-tiny --family qwen3_moe`)."""
    from rackserve.models.qwen3_moe.tiny import make_tiny as make_tiny_qwen3

    return make_tiny_qwen3(tmp_path_factory.mktemp("qwen3-moe"), seed=0)


@pytest.fixture(scope="session")
def v41_reference(v41_checkpoint):
    """The plain slow V4.1 forward of `tests/v41_reference.py` over the same files."""
    from v41_reference import ReferenceV41

    return ReferenceV41(v41_checkpoint)


@pytest.fixture(scope="session")
def reference(ref_checkpoint):
    from transformers import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM.from_pretrained(ref_checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def ours(ref_checkpoint):
    return load_model(ref_checkpoint)


# The one Ray cluster of the test session: 2 racks x 2 trays, each tray a node with 2 logical GPUs
# (Ray accepts GPUs without devices) and its rack/tray labels; the head node is rack0/tray0. It is
# started for direct ingress: an endpoint replica also serves HTTP itself on `cluster.direct_port`.
@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from rackserve.bench.rack_cluster import RackCluster
    from rackserve.serve.ingress import direct_ingress_env

    # the nodes' processes get these, this one need not: direct ingress for up to four replicas at once
    # (test_serve runs two apps, test_serve_scale_out two replicas and their replacements; a port whose
    # server side closed connections stays unusable to Serve for a minute)
    direct_port = free_ports(5)  # apps=4: ports port … port + 4
    cluster = RackCluster(RACKS, TRAYS, GPUS_PER_TRAY, env=direct_ingress_env(direct_port, apps=4,
                                                                              load_balanced=False))
    cluster.direct_port = direct_port
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="module")
def serve_port(ray_cluster):
    """Serve for the module's apps, its proxy on the head node: the proxy's port on 127.0.0.1. Shut down
    after the module, so that an app a failed module left behind never reaches the next."""
    from ray import serve

    port = free_ports(1)
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    yield port
    serve.shutdown()
