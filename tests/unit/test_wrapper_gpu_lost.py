"""The wrapper's verdict when migd says the job's GPU was lost (an NVML XID), with a
stand-in client: the loss seen only in the release reply (the job died with its GPU
before the wrapper's next poll), and a job that finished before the loss."""

from __future__ import annotations

import io
import sys
from typing import Any

import pytest

from migd.wrapper.jobspec import spec_from_flags
from migd.wrapper.leasing import WrapperFailure
from migd.wrapper.runner import LEASE_LOST_EXIT_CODE, JobRunner

LOST = "GPU lost: XID 48 (double-bit ECC error) on GPU 1: the job's GPU work is lost"


class LostAtRelease:
    """A daemon that grants a lease on GPU 1 and reports the loss only at release."""

    def __init__(self) -> None:
        self.released: list[str] = []

    def lease(self, **request: Any) -> dict[str, Any]:
        return {
            "lease_id": "L1",
            "gpu": 1,
            "gpu_uuid": "GPU-1111",
            "mode": "mig",
            "profile": "1g.10gb",
            "memory_limit_mib": 9856,
            "env": {},
        }

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        return {"warning": ""} if op == "get_lease" else {}

    def release(self, lease_id: str, reason: str) -> dict[str, Any]:
        self.released.append(lease_id)
        return {"state": "released", "gpu_lost": LOST}


def runner(*command: str) -> tuple[JobRunner, LostAtRelease]:
    client = LostAtRelease()
    spec = spec_from_flags(list(command), gpu_memory="5G", job_id="12.0")
    return JobRunner(spec, client, err=io.BytesIO()), client  # type: ignore[arg-type]


def test_a_job_that_failed_with_its_gpu_is_requeued_with_migds_reason() -> None:
    run, client = runner(sys.executable, "-c", "raise SystemExit(3)")
    with pytest.raises(WrapperFailure) as failed:
        run.run()
    # Exit 85 (was 1 before the lease end reasons): a lease migd took back, documented.
    assert failed.value.exit_code == LEASE_LOST_EXIT_CODE and not failed.value.start_failure
    assert failed.value.message.startswith(f"migd: {LOST} (lease L1, GPU GPU-1111)")
    assert client.released == ["L1"]


def test_a_job_that_finished_before_the_loss_keeps_its_result() -> None:
    run, client = runner(sys.executable, "-c", "raise SystemExit(0)")
    assert run.run() == 0
    assert client.released == ["L1"]
