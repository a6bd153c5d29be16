"""One run's measurements: memory sampled in the background, steps timed after device sync."""

from __future__ import annotations

from typing import Any

from zerotune.telemetry import MemorySampler, StepTimer, pinned_memory_mib, torch_cuda_memory_stats
from zerotune.telemetry.phases import PhaseTimeline

# Steps left out of the step-time statistics: kernel builds, allocator growth and caches settle in them.
WARMUP_STEPS = 5


class RunTelemetry:
    def __init__(self, nvme_dir: str | None, synchronize=None, started: float | None = None):
        """`started`: when this process's start-up began (epoch s; default: the process's creation)."""
        self.sampler = MemorySampler(nvme_dir=nvme_dir)
        self.timer = StepTimer(synchronize=synchronize, process_start=started)
        # The run's phases (loading, caching, step, sampling): each resets torch's peak statistics as it begins.
        self.phases = PhaseTimeline(self.sampler)

    def __enter__(self) -> RunTelemetry:
        self.sampler.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.sampler.stop()

    def step_memory(self) -> dict:
        """Current figures for one metrics row (a synchronous sample: the step boundary is a peak candidate)."""
        now = self.sampler.sample_now()
        cuda = torch_cuda_memory_stats()
        return {"memory/host_rss_mib": now.get("host_peak_rss_mib"), "memory/gpu_process_mib":
                now.get("gpu_peak_process_mib"), "memory/gpu_device_mib": now.get("gpu_peak_device_mib"),
                "memory/nvme_mib": now.get("nvme_peak_mib"),
                "memory/gpu_max_allocated_mib": cuda["gpu_peak_allocated_mib"],
                "memory/gpu_max_reserved_mib": cuda["gpu_peak_reserved_mib"]}

    def summary(self) -> dict[str, Any]:
        peaks, cuda = self.sampler.peaks(), torch_cuda_memory_stats()
        # torch's peaks restart with each phase: the run's are the largest of the phases' and the current ones.
        by_phase = self.phases.gpu_peaks()
        for key, phase_key in (("gpu_peak_reserved_mib", "gpu_max_reserved_mib"),
                               ("gpu_peak_allocated_mib", "gpu_max_allocated_mib")):
            cuda[key] = max((v for v in (cuda[key], by_phase[phase_key]) if v is not None), default=None)
        return {
            "memory": {
                "gpu_peak_process_mib": peaks["gpu_peak_process_mib"],
                "gpu_peak_device_mib": peaks["gpu_peak_device_mib"],
                "gpu_peak_allocated_mib": cuda["gpu_peak_allocated_mib"],
                "gpu_peak_reserved_mib": cuda["gpu_peak_reserved_mib"],
                "gpu_alloc_retries": cuda["alloc_retries"],
                "gpu_ooms": cuda["ooms"],
                "host_peak_rss_mib": peaks["host_peak_rss_mib"],
                "host_pinned_peak_mib": pinned_memory_mib(),
                "nvme_peak_mib": peaks["nvme_peak_mib"],
                "sampler_interval_s": self.sampler.interval_s,
                "phases": self.phases.records,  # the same list: a phase ended later (sampling) is in it too
            },
            "perf": self.timer.summary(WARMUP_STEPS),
        }
