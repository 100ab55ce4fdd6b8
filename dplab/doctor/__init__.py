"""The job doctor: what dplab says about *your* torch DDP job, read from its own traces.

Diagnosis, not simulation: it reads a user's torch.profiler trace (:mod:`.from_trace`: the
job's compute profile, its collectives, its measured steps), names the rank the others wait
for (:mod:`.straggler`), and asks the simulator (:mod:`dplab.sim`, one layer down) what the step
would be at other bucket caps (:mod:`.doctor`), after splitting the whole step (:mod:`.budget`).
The simulator knows nothing of the doctor.

    d = dplab.doctor.diagnose("traces/")   # one torch.profiler trace per rank
    print(d.summary())

Names are imported on first use (:mod:`dplab._lazy`), like the other packages.
"""

from dplab._lazy import lazy_exports

__getattr__, __dir__, __all__ = lazy_exports(
    globals(),
    {
        "dplab.doctor.budget": [
            "TERMS",
            "Achieved",
            "Budget",
            "StepBudget",
            "achieved_bandwidth",
            "overlap_share",
            "step_budget",
            "step_budgets",
        ],
        "dplab.doctor.doctor": [
            "CapRow",
            "Diagnosis",
            "Spread",
            "consistent_with_default",
            "diagnose",
            "first_cap",
            "infer_cap",
        ],
        "dplab.doctor.from_trace": [
            "MAD_SIGMA",
            "MEDIAN_SE",
            "BucketRow",
            "Collective",
            "StepRow",
            "by_step",
            "collective_samples",
            "collectives",
            "fit_contention",
            "fit_link",
            "job_link",
            "job_links",
            "measured_steps",
            "prior_link",
            "profile_from_trace",
            "service_times",
            "simulate_lanes",
        ],
        "dplab.doctor.jobs": [
            "FRESH_PAGES",
            "median_step_faults",
            "profile_torch_job",
            "wide_model",
        ],
        "dplab.doctor.straggler": ["Straggler", "find_straggler"],
        "dplab.doctor.flight_recorder": ["HangReport", "analyze", "read_flight_recorder"],
        "dplab.doctor.frtrace": ["fixed_up_copy", "torchfrtrace_verdicts"],
    },
)
