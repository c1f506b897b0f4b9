"""The hybrid benchmark's three ways of running a Gated DeltaNet layer compute the same layer (float64, CP 2),
and blockdiag's bytes are exactly its plan's: the summaries and the convolution's history."""

from __future__ import annotations

import pytest
import torch

from bench.hybrid import (C, HK, HV, K, KDA_LAYER, LIGHTNING_LAYER, METHODS, MIXER_LAYERS, SCAN_LAYER, SSD_LAYER, V, WIDTH,
                          _ids, baseline_agreement, kda_bytes, kda_plan_bytes, lightning_bytes, lightning_plan_bytes,
                          mixer_cp_times, mixer_output, mixer_single_times, scan_bytes, scan_plan_bytes, ssd_bytes,
                          ssd_plan_bytes, summary_bytes)
from blockdiag_dist.plan import plan_step

pytestmark = pytest.mark.usefixtures("one_thread")


def test_baselines_compute_the_same_layer_and_blockdiag_moves_its_plan(pools):
    S = 1024
    per_rank = pools(2).run(baseline_agreement, args=(S, 0, "float64"), timeout=240, name="hybrid bench baselines")
    plan = plan_step(_ids(S, 0), 2, "contiguous")
    for r, res in enumerate(per_rank):
        assert all(res["max_diff"][m] < 1e-12 for m in METHODS), res["max_diff"]
        history = plan.exchange(WIDTH - 1).needed_tokens()[r] * C * 8
        assert res["recv_bytes"]["blockdiag"] == 2 * summary_bytes(plan, r) + history  # float64: 8 bytes
    assert per_rank[1]["recv_bytes"]["blockdiag"] > 0 and HV * K * V * 8 <= per_rank[1]["recv_bytes"]["blockdiag"]
    assert per_rank[0]["recv_bytes"]["allgather"] == (S // 2) * (C + 2 * HV) * 8 and HK % 2 == 0


def test_the_mamba2_and_kda_layers_move_exactly_their_plan(pools):
    """The SSD and KDA figures: each rank receives its plan's summaries and history (float64: 8 bytes an element),
    flat in S."""
    S = 1024
    plan = plan_step(_ids(S, 0), 2, "contiguous")
    per_rank = pools(2).run(ssd_bytes, args=(S, 0, "float64"), timeout=240, name="hybrid bench ssd bytes")
    for r, res in enumerate(per_rank):
        want = ssd_plan_bytes(plan, r, element=8)
        assert res["recv_bytes"] == want["summaries"] + want["history"], (r, res, want)
    per_rank = pools(2).run(kda_bytes, args=(S, 0, "float64"), timeout=240, name="hybrid bench kda bytes")
    for r, res in enumerate(per_rank):
        want = kda_plan_bytes(plan, r, element=8)
        assert res["recv_bytes"] == want["summaries"] + want["history"], (r, res, want)
    assert kda_plan_bytes(plan, 1, element=8)["summaries"] == KDA_LAYER["H"] * KDA_LAYER["K"] ** 2 * 8
    m = SSD_LAYER
    assert ssd_plan_bytes(plan, 1, element=8)["summaries"] == m["H"] * m["Dh"] * m["N"] * 8  # one first piece crosses


def test_the_mamba1_layer_moves_exactly_its_plan(pools):
    """The selective-scan figure: each rank receives its plan's summaries (``I * N`` per continuing piece) and
    history (float64: 8 bytes an element)."""
    S = 1024
    plan = plan_step(_ids(S, 0), 2, "contiguous")
    per_rank = pools(2).run(scan_bytes, args=(S, 0, "float64"), timeout=240, name="hybrid bench scan bytes")
    for r, res in enumerate(per_rank):
        want = scan_plan_bytes(plan, r, element=8)
        assert res["recv_bytes"] == want["summaries"] + want["history"], (r, res, want)
    assert scan_plan_bytes(plan, 1, element=8)["summaries"] == SCAN_LAYER["I"] * SCAN_LAYER["N"] * 8  # one piece crosses


def test_the_kda_and_mamba1_steps_are_the_single_device_layer_and_are_timed(pools):
    """The layers the section times at CP 2 against one device compute the same thing (float64: the ranks' outputs
    together are the single device's), and both timings run forward and backward for both layers."""
    S = 300  # not a multiple of the CP size: the last rank holds padding rows
    for layer in MIXER_LAYERS:
        per_rank = pools(2).run(mixer_output, args=(layer, S, 0), timeout=240, name=f"hybrid bench {layer} output")
        one = mixer_output(layer, S, 0)
        got = torch.cat(per_rank, dim=1)[:, :S]
        assert got.shape == one.shape and torch.allclose(got, one, rtol=1e-10, atol=1e-12), (layer, (got - one).abs().max())
        assert got.abs().max() > 0
    cp = pools(2).run(mixer_cp_times, args=(S, 0, MIXER_LAYERS, 1), timeout=240, name="hybrid bench kda/mamba1 times")
    single = mixer_single_times(S, 0, MIXER_LAYERS, 1, threads=1)
    for seconds in [r["seconds"] for r in cp] + [single]:
        assert set(seconds) == set(MIXER_LAYERS) and all(t > 0 for t in seconds.values()), seconds


def test_the_lightning_layer_moves_exactly_its_plan(pools):
    """The lightning-attention figure: each rank receives its plan's summaries (``H * D * D`` per continuing piece,
    ``H`` more with a transition; no history), float64: 8 bytes an element; the ranks' outputs together are the
    single device's."""
    S = 1024
    plan = plan_step(_ids(S, 0), 2, "contiguous")
    per_rank = pools(2).run(lightning_bytes, args=(S, 0, "float64"), timeout=240, name="hybrid bench lightning bytes")
    for r, res in enumerate(per_rank):
        want = lightning_plan_bytes(plan, r, element=8)
        assert res["recv_bytes"] == want["summaries"], (r, res, want)
    m = LIGHTNING_LAYER
    assert lightning_plan_bytes(plan, 1, element=8)["summaries"] == m["H"] * m["D"] ** 2 * 8  # one first piece crosses
    S = 300  # the layer whose bytes these are computes what the single device computes
    per_rank = pools(2).run(mixer_output, args=("lightning", S, 0), timeout=240, name="hybrid bench lightning output")
    one = mixer_output("lightning", S, 0)
    got = torch.cat(per_rank, dim=1)[:, :S]
    assert got.shape == one.shape and torch.allclose(got, one, rtol=1e-10, atol=1e-12), (got - one).abs().max()
    assert got.abs().max() > 0
