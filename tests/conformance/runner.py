"""The conformance coordinator: a pool of W rank processes runs torch's DDP tests one by one.

Each test gets its own process group (a fresh ``file://`` store and temp folder) and a time
limit. Starting W processes that import torch's test suite takes seconds, so the pool is kept
between tests; a test that fails on one rank while another waits in a collective, or that
passes its time limit, costs the pool: every process of its session is killed and the next
test starts a fresh pool. Nothing is left running when :class:`Pool` closes.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TIME_LIMIT_S = 180.0  # per test (torch: 300 s); the slowest that passes here, uneven inputs, ~130 s
GRACE_S = 10.0  # after one rank failed: how long the others get to report before the kill
REFUSAL = "dplab.DDP does not support"  # every refusal by name says this


@dataclass(frozen=True)
class Result:
    """One test on one DDP: ``outcome`` is pass, fail, skip, refused or timeout."""

    test: str
    ddp: str  # "torch" or "dplab"
    world: int
    shim: bool
    outcome: str
    detail: str = ""

    @property
    def key(self) -> tuple[str, str, int, bool]:
        return (self.test, self.ddp, self.world, self.shim)


def summarize(ranks: list[dict]) -> tuple[str, str]:
    """The test's outcome from its ranks': a failure anywhere wins, then a skip."""
    for r in ranks:
        if r["outcome"] == "fail":
            detail = f"rank {r['rank']}: {r['detail']}"
            return ("refused" if REFUSAL in r["detail"] else "fail"), detail
    for r in ranks:
        if r["outcome"] == "skip":
            return "skip", r["detail"]
    return "pass", ""


class Pool:
    """W worker processes (``tests.conformance.worker``) for one DDP, world size and shim."""

    def __init__(self, ddp: str, world: int, shim: bool, pythonpath: Path = REPO):
        self.ddp, self.world, self.shim, self.pythonpath = ddp, world, shim, pythonpath
        self.root = Path(tempfile.mkdtemp(prefix="dplab-conformance-"))
        self.procs: list[subprocess.Popen] = []
        self.count = 0

    def _start(self) -> None:
        env = dict(os.environ)
        env.update(
            PYTHONPATH=f"{self.pythonpath}{os.pathsep}{REPO}",
            WORLD_SIZE=str(self.world),
            BACKEND="gloo",
            DPLAB_CONFORMANCE_DDP=self.ddp,
            DPLAB_CONFORMANCE_SHIM="1" if self.shim else "0",
            MASTER_ADDR="127.0.0.1",
            OMP_NUM_THREADS="1",
        )
        for rank in range(self.world):
            log = open(self.root / f"rank{rank}.log", "ab")  # noqa: SIM115 (the child owns it)
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tests.conformance.worker"],
                    cwd=self.pythonpath,  # first on sys.path: a planted-bug copy of dplab wins
                    env={**env, "RANK": str(rank)},
                    stdin=subprocess.PIPE,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            log.close()

    def kill(self) -> None:
        """End every process of every rank's session (a test may have started its own)."""
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            if p.stdin:
                with contextlib.suppress(OSError):  # a dead rank's pipe may still hold a command
                    p.stdin.close()
        self.procs = []

    def close(self) -> None:
        self.kill()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run(self, test: str, time_limit: float = TIME_LIMIT_S) -> Result:
        """Run ``test`` on every rank; a fresh pool if the last test cost the old one."""
        if not self.procs:
            self._start()
        self.count += 1
        work = self.root / f"t{self.count}"
        for sub in ("barrier", "test_dir", "init_dir"):
            (work / sub).mkdir(parents=True)
        outs = [work / f"rank{r}.json" for r in range(self.world)]
        for rank, p in enumerate(self.procs):
            cmd = {
                "test": test,
                "init_file": str(work / "init_dir" / "store"),
                "temp_dir": str(work),
                "out": str(outs[rank]),
            }
            try:
                p.stdin.write((json.dumps(cmd) + "\n").encode())  # type: ignore[union-attr]
                p.stdin.flush()  # type: ignore[union-attr]
            except BrokenPipeError:
                pass
        outcome, detail = self._wait(outs, time_limit)
        shutil.rmtree(work, ignore_errors=True)
        return Result(test, self.ddp, self.world, self.shim, outcome, detail)

    def _wait(self, outs: list[Path], time_limit: float) -> tuple[str, str]:
        start, failed_at = time.monotonic(), None
        # Importing torch's suite in a fresh pool is not the test's time.
        while True:
            done = [json.loads(o.read_text()) for o in outs if o.exists()]
            if len(done) == len(outs):
                return summarize(done)
            dead = [p for p in self.procs if p.poll() is not None]
            if failed_at is None and (dead or any(d["outcome"] == "fail" for d in done)):
                failed_at = time.monotonic()
            now = time.monotonic()
            if failed_at is not None and now - failed_at > GRACE_S:
                self.kill()
                crashed = [f"rank {self.procs.index(p)} exited" for p in dead if p in self.procs]
                outcome, detail = summarize(done) if done else ("fail", "")
                if outcome == "pass":
                    outcome = "fail"
                return outcome, (detail or "; ".join(crashed) or "a rank died")
            if now - start > time_limit:
                self.kill()
                return "timeout", f"no result within {time_limit:.0f} s (pool killed)"
            time.sleep(0.05)


def run_tests(
    tests: list[str],
    ddp: str,
    world: int,
    shim: bool,
    time_limit: float = TIME_LIMIT_S,
    pythonpath: Path = REPO,
) -> list[Result]:
    """Each of ``tests`` once, in one pool."""
    with Pool(ddp, world, shim, pythonpath) as pool:
        return [pool.run(t, time_limit) for t in tests]


def load(path: Path) -> dict[tuple, Result]:
    """Results saved by earlier runs (one JSON object a line), by key."""
    out: dict[tuple, Result] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                r = Result(**json.loads(line))
                out[r.key] = r
    return out


def append(path: Path, result: Result) -> None:
    with path.open("a") as f:
        f.write(json.dumps(asdict(result)) + "\n")
