"""Run telemetry: memory peaks, step timing, environment, plots."""

from zerotune.telemetry.env import environment_info, node_identity
from zerotune.telemetry.memory import MemorySampler
from zerotune.telemetry.timing import StepTimer
from zerotune.telemetry.torch_memory import pinned_memory_mib, torch_cuda_memory_stats

__all__ = ["MemorySampler", "StepTimer", "environment_info", "node_identity", "pinned_memory_mib", "torch_cuda_memory_stats"]
