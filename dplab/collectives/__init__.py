"""All-reduce from first principles: the ring, the naive contrast, and what they cost.

Data parallelism needs exactly one collective: after backward, every rank holds its own gradient
``g_i`` and must end with their sum (torch's DDP divides each ``g_i`` by N before summing, so the
sum is the average). This package builds that all-reduce from nothing but point-to-point
``isend``/``irecv``, two ways:

* **naive** (gather to one, then broadcast): rank 0 receives every other rank's whole tensor,
  sums, and sends the sum back. Simple, but rank 0's link carries ``(N-1)·S`` bytes in and
  ``(N-1)·S`` out, so the time grows with N.
* **ring** (reduce-scatter, then all-gather): the tensor is cut into N chunks and the ranks pass
  chunks round a ring. In N-1 *reduce-scatter* steps each rank adds the chunk arriving from its
  left neighbour into its own copy; afterwards rank r holds the full sum of chunk ``(r+1) mod N``.
  In N-1 *all-gather* steps the finished chunks travel once more round the ring, overwriting.
  Every rank sends (and receives) ``2(N-1)/N · S`` bytes whatever N is: the ring is
  bandwidth-optimal, which is why NCCL and gloo use ring-like schedules for large tensors.

The α-β model prices a message of ``b`` bytes at ``α + b·β`` (α: per-message latency, β: seconds
per byte, i.e. 1/bandwidth). The ring makes ``2(N-1)`` sequential steps of ``S/N`` bytes:

    ring_time  = 2(N-1)·α + 2(N-1)/N · S·β
    naive_time = 2(N-1)·α + 2(N-1) · S·β      (rank 0's link serialises N-1 messages each way)

The model ignores the time to add the numbers (a γ·S term), which is small next to moving them.

Benchmarks report two bandwidths, as nccl-tests defines them (``doc/PERFORMANCE.md`` in
https://github.com/NVIDIA/nccl-tests): ``algbw = S / t`` and ``busbw = algbw · 2(N-1)/N``. busbw
removes the ring's N-dependence, so it is comparable across world sizes and, for large S, tends
to the link bandwidth ``1/β``.

Why ring and ``dist.all_reduce`` can differ in the last bits (floats): each element's N addends
are added in an order fixed by the schedule. Here chunk c is summed starting at rank c and going
round the ring (``((x_c + x_{c+1}) + x_{c+2}) + …``); gloo uses its own schedule, with its own
segments and partner order, and float addition is not associative. With N = 2 there is only one
addition (commutative), so the results are bit-identical; integers are exact for every N. Within
one algorithm every rank ends with the same bits, because the all-gather *copies* finished chunks.

Modules: :mod:`~dplab.collectives.schedule` (pure schedules), :mod:`~dplab.collectives.allreduce`
(the real ring and naive all-reduce on ranks), :mod:`~dplab.collectives.cost` (α-β, algbw,
busbw, the fit), :mod:`~dplab.collectives.bench` (the bandwidth bench).
"""

from dplab._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    globals(),
    {
        "dplab.collectives.allreduce": ["OPS", "naive_all_reduce", "ring_all_reduce"],
        "dplab.collectives.bench": [
            "ALGORITHMS",
            "BandwidthRow",
            "bandwidth_bench",
            "bandwidth_report",
            "fit_rows",
            "format_fit",
            "format_table",
            "geometric_sizes",
            "measure_bandwidth",
            "measure_fit",
        ],
        "dplab.collectives.cost": [
            "AlphaBetaFit",
            "algbw",
            "bus_factor",
            "busbw",
            "fit_alpha_beta",
            "naive_bytes_per_rank",
            "naive_time",
            "ring_bytes_per_rank",
            "ring_time",
        ],
        "dplab.collectives.schedule": [
            "ALL_GATHER",
            "BROADCAST",
            "GATHER",
            "REDUCE_SCATTER",
            "Transfer",
            "chunk_bounds",
            "naive_schedule",
            "ring_partial_sums",
            "ring_phase",
            "ring_recv_chunk",
            "ring_schedule",
            "ring_send_chunk",
            "ring_steps",
        ],
    },
)
