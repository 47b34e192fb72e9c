"""The probe times a collective as nccl-tests does: each sample is CALLS back-to-back calls
between two readings of one timer (the host clock on CPU, CUDA events on GPU), never one call
between a barrier and a synchronize, whose launch latency and barrier skew would be as long as
an NVLink transfer. Checked on 2 real gloo ranks."""

import statistics

import pytest

from slurm_autosp.probe.collectives import CollectiveTiming
from slurm_autosp.probe.timing import CALLS, SAMPLES, WARMUP
from tests._dist_pool import dist_pools as dist_pools  # the session's pools

NBYTES = 1 << 16
# nccl-tests' bus bandwidth factors for n ranks (doc/PERFORMANCE.md): what crosses each link
BUS = {"all_reduce": lambda n: 2 * (n - 1) / n, "reduce_scatter": lambda n: (n - 1) / n}
BUS["all_to_all"] = BUS["reduce_scatter"]


@pytest.fixture(scope="module")
def pool2(dist_pools):
    return dist_pools(2)


@pytest.mark.parametrize("collective", ["all_reduce", "all_to_all"])
def test_a_sample_is_calls_back_to_back_and_the_time_is_per_call(pool2, collective):
    for rank in pool2.run("probe_cases:timed_calls", collective, NBYTES):
        spans = rank["spans"]
        assert len(spans) == WARMUP + SAMPLES * CALLS
        samples = [spans[WARMUP + k * CALLS : WARMUP + (k + 1) * CALLS] for k in range(SAMPLES)]
        # the timer brackets the sample's calls: from the first call's start to the last's end
        per_call = statistics.median((calls[-1][1] - calls[0][0]) / CALLS for calls in samples)
        assert rank["seconds"] == pytest.approx(per_call, rel=0.1)


@pytest.mark.parametrize("collective", ["all_reduce", "reduce_scatter", "all_to_all"])
def test_bus_bandwidth_is_nccl_tests_formula_over_the_time_per_call(pool2, collective):
    for rank in pool2.run("probe_cases:timed_calls", collective, NBYTES):
        sent, seconds, latency = rank["message"]
        timing = CollectiveTiming(
            collective, "test", "dp", 0, 2, sent, seconds, latency, CALLS, None, ""
        )
        assert sent == NBYTES and 0 < latency and 0 < seconds
        assert timing.algbw_gb_per_s == pytest.approx(NBYTES / seconds / 1e9)
        assert timing.busbw_gb_per_s == pytest.approx(NBYTES / seconds / 1e9 * BUS[collective](2))
