"""The host: the machine (platform, RAM, processes and their signals and logs), run telemetry (memory peaks, step
timing, plots), and DeepSpeed's JIT ops built in the job's parent (`ops`, with the cache's locks and environment)."""
