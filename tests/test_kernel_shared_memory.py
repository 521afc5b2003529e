"""Every Triton kernel's launch at V4-Flash's sizes fits the shared memory sm_90 and sm_100 give a block,
by the estimate of `rackserve.gpu_check.shared_memory` (launch parameters recorded from the real
launchers on the meta device: nothing runs), and the estimate covers what offline compiles measured."""

from __future__ import annotations

import pytest

from rackserve.gpu_check.shared_memory import LIMITS, describe, estimate, launches


@pytest.mark.parametrize("tokens", [1, 256, 8192])
def test_every_launch_fits_sm90_and_sm100(tokens):
    recorded = launches(tokens)
    assert {launch.kernel for launch in recorded} >= {"_sink_attention_kernel", "_indexer_topk_kernel",
                                                       "_gate_up_swiglu_kernel", "_down_kernel", "_linear_kernel",
                                                       "_mhc_weights_kernel", "_route_kernel"}
    for arch, limit in LIMITS.items():
        over = [f"{launch.kernel} {describe(launch)}: {estimate(launch)} B" for launch in recorded
                if estimate(launch) > limit]
        assert not over, f"over {arch}'s {limit} B a block: {over}"


def test_the_indexer_on_packed_keys_scores_apart_and_fits():
    """Packed keys used to go through the fused top-k, whose decoded 512-candidate tile needed
    413,696 B on sm_90; now they are scored apart, and the top-k reads the stored scores."""
    recorded = launches(256)
    assert not [launch for launch in recorded if launch.kernel == "_indexer_topk_kernel" and launch.args["KEY_BITS"]]
    apart = [launch for launch in recorded if launch.kernel == "_top_of_scores_kernel"]
    assert apart and all(estimate(launch) <= min(LIMITS.values()) for launch in apart)


# bytes `triton.compile` reported for these launches (triton 3.9, sm_90 and sm_100, the larger), T = 256
COMPILED = {
    ("_sink_attention_kernel", "BLOCK_K=16 BLOCK_H=16 BLOCK_D=512 warps=8"): 49408,
    ("_sink_attention_kernel", "packed rows BLOCK_K=16 BLOCK_H=16 BLOCK_D=512 warps=8"): 114944,
    ("_indexer_topk_kernel", "BLOCK_H=64 BLOCK_D=128 BLOCK_K=512 warps=4"): 147456,
    ("_indexer_scores_kernel", "BLOCK_H=64 BLOCK_D=128 BLOCK_E=32 warps=4"): 24584,
    ("_indexer_scores_kernel", "packed rows BLOCK_H=64 BLOCK_D=128 BLOCK_E=32 warps=4"): 41224,
    ("_linear_kernel", "FP8 weights BLOCK_M=64 BLOCK_N=64 BLOCK_K=64 warps=4"): 24592,
}


def test_estimates_cover_offline_compiles():
    estimates = {(launch.kernel, describe(launch)): estimate(launch) for launch in launches(256)}
    for key, compiled in COMPILED.items():
        assert compiled <= estimates[key] <= compiled + 2048, (key, estimates[key], compiled)
