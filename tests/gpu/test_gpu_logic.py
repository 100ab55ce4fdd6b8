"""The parts of tests/gpu/run_gpu_checks.py that need no GPU, run on CPU in CI.

A GPU run is what proves the CUDA paths; these prove that the script's logic would tell a pass
from a failure: the stream-ordering judge refuses a run whose negative controls are not caught
(on CPU there is no asynchrony, so they cannot be), the kernel-span reader picks the stand-in's
kernels out of a Chrome trace, and the bit-for-bit comparison with torch DDP runs on 2 gloo
ranks.
"""

from __future__ import annotations

import json

import pytest
import torch

import dplab
from tests.gpu import kernels, ordering, run_gpu_checks


def _cpu_variants() -> dict:
    streams = ordering.ImmediateStreams()
    return {v: ordering.run_variant(streams, v) for v in ordering.VARIANTS}


def test_stand_in_hook_on_cpu_matches_the_reference_and_the_judge_refuses_it():
    (diffs,) = dplab.launch(_cpu_variants, 1)
    # no streams: every variant runs in program order and equals the synchronous reference
    assert all(d <= ordering.MATCH_TOL for d in diffs.values()), diffs
    with pytest.raises(AssertionError, match="not caught"):
        ordering.judge(diffs)


def test_judge_on_gpu_like_results():
    ok = {"honest": 0.0, "complete_early": 3e-3, "no_launch_wait": 2e-3}
    assert ordering.judge(ok)["diffs"] == ok
    with pytest.raises(AssertionError, match="not ordered before the optimizer"):
        ordering.judge({**ok, "honest": 1e-3})
    with pytest.raises(AssertionError, match=r"\['no_launch_wait'\] not caught"):
        ordering.judge({**ok, "no_launch_wait": 0.0})
    with pytest.raises(ValueError, match="no result"):
        ordering.judge({"honest": 0.0})


def test_stand_in_hook_rejects_an_unknown_variant():
    with pytest.raises(ValueError, match="variant must be one of"):
        ordering.stand_in_hook(ordering.ImmediateStreams(), "sloppy", 1.0)


def _kernel(name: str, ts: float, dur: float, stream: int) -> dict:
    return {
        "ph": "X",
        "cat": "kernel",
        "name": name,
        "ts": ts,
        "dur": dur,
        "args": {"stream": stream},
    }


def test_kernel_spans_pair_each_spin_with_the_next_kernel_on_its_stream():
    trace = {
        "traceEvents": [
            _kernel("void at::cuda::(anonymous namespace)::spin_kernel(long)", 100, 2000, 13),
            _kernel("gemm", 150, 500, 7),  # compute stream: not part of the collective
            _kernel("vectorized_elementwise_kernel", 2110, 15, 13),
            _kernel("spin_kernel(long)", 2200, 1000, 13),
            {"ph": "X", "cat": "cpu_op", "name": "aten::mul_", "ts": 2100, "dur": 5},
            _kernel("vectorized_elementwise_kernel", 3205, 10, 13),
        ]
    }
    assert kernels.kernel_spans(trace) == [(100.0, 2125.0), (2200.0, 3215.0)]
    trace["traceEvents"].pop()
    with pytest.raises(ValueError, match="no kernel after it"):
        kernels.kernel_spans(trace)


def test_mismatches_use_five_percent_or_fifty_microseconds():
    ours, theirs = [2000.0, 1030.0, 40.0, 900.0], [2090.0, 1000.0, 85.0, 1000.0]
    assert kernels.mismatches(ours, theirs) == [(3, 900.0, 1000.0)]
    with pytest.raises(AssertionError, match="3 dplab spans but 4"):
        kernels.mismatches(ours[:3], theirs)


def test_dplab_equals_torch_ddp_bit_for_bit_on_two_cpu_ranks(cluster2):
    results = cluster2.run(run_gpu_checks.train_pair, "cpu")
    assert run_gpu_checks.judge_pair(results)["ranks"][0]["device"] == "cpu"
    with pytest.raises(AssertionError):
        run_gpu_checks.judge_pair([{**results[0], "dplab_vs_torch": 1e-7}])


def test_sparse_side_by_side_is_bit_for_bit_on_two_cpu_ranks_and_the_judge_refuses_a_gap(cluster2):
    results = cluster2.run(run_gpu_checks.sparse_side_by_side, "cpu")
    assert run_gpu_checks.judge_mixed_and_sparse(results)["ranks"][0]["sparse"]["grad_gap"] == 0.0
    bad = {"sparse": {**results[0]["sparse"], "weight_gap": 1e-7}}
    with pytest.raises(AssertionError):
        run_gpu_checks.judge_mixed_and_sparse([bad])
    fp16 = {"sparse": {**results[0]["sparse"], "grad_dtypes": ["torch.float16"]}}
    with pytest.raises(AssertionError):
        run_gpu_checks.judge_mixed_and_sparse([fp16])


def test_memory_check_needs_a_gpu():
    from tests.gpu.check_memory import check_memory

    if torch.cuda.is_available():
        pytest.skip("a GPU is here: run tests/gpu/run_gpu_checks.py instead")
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        check_memory()


def test_script_reports_a_failed_check_and_exits_non_zero(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the check would run")
    out = tmp_path / "r.json"
    code = run_gpu_checks.main(["--out", str(out), "--only", "check_memory_on_gpu"])
    report = json.loads(out.read_text())
    assert code == 1
    assert list(report["checks"]) == ["check_memory_on_gpu"]
    assert report["checks"]["check_memory_on_gpu"]["ok"] is False
    assert "needs a CUDA GPU" in report["checks"]["check_memory_on_gpu"]["error"]


def test_memory_checks_formula_reads_the_measured_models_shape():
    from dplab.memory.activations import gpt_activation_bytes
    from tests.gpu.check_memory import GPT_KWARGS, MICRO_BATCH, SEQ_LEN, korthikanti_bytes

    want = gpt_activation_bytes(SEQ_LEN, MICRO_BATCH, 1024, 16, 8)
    assert GPT_KWARGS["d_model"] == 1024 and korthikanti_bytes() == want
