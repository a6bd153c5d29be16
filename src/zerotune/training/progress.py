"""Console progress: a live bar on a terminal, plain periodic lines everywhere else (CI, log files)."""

from __future__ import annotations

import logging
import sys

log = logging.getLogger("zerotune")


def _fmt(row: dict) -> dict:
    mem = row.get("memory/gpu_process_mib")
    host = row.get("memory/host_rss_mib")
    return {"loss": f"{row['loss/train']:.4f}", "s/it": f"{row['perf/step_time_s']:.3f}",
            "host": f"{host:.0f}MiB" if host is not None else "-",
            "gpu": f"{mem:.0f}MiB" if mem is not None else "-"}


class Progress:
    def __init__(self, total: int, enabled: bool, every: int = 25, stream=None):
        self.total, self.enabled, self.every = total, enabled, max(every, 1)
        stream = stream or sys.stderr
        self.bar = None
        if enabled and stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc="train", unit="step", file=stream, dynamic_ncols=True)

    def update(self, row: dict) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix(_fmt(row), refresh=False)
            self.bar.update(1)
        elif row["step"] % self.every == 0 or row["step"] in (1, self.total):
            f = _fmt(row)
            log.info("step %d/%d  loss %s  %s s/it  host %s  gpu %s", row["step"], self.total, f["loss"],
                     f["s/it"], f["host"], f["gpu"])

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
