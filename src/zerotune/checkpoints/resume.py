"""Loading a checkpoint into the prepared engine: natively, or converted (which one and how was decided
before any model existed: zerotune/checkpoints/select.py and decide.py)."""

from __future__ import annotations

import torch

from zerotune.checkpoints import EMA_FILE, ResumeDecision, convert


def load(acc, decision: ResumeDecision, module, optimizer, scheduler) -> tuple[dict, dict | None]:
    """Restore the checkpoint into the prepared engine/optimizer/scheduler (every rank); returns this rank's
    data position and generators (Trainer.load_position_state), and the EMA's state or None."""
    if decision.mode == "native":
        acc.load_state(str(decision.path))
    elif decision.mode == "universal":
        acc.load_state(str(convert.universal_folder(acc, decision.path)))
    else:
        convert.load_full(acc, decision.path, decision.meta, module, optimizer, scheduler)
    _steps_as_tensors(optimizer)
    ema_file = decision.path / EMA_FILE
    ema = torch.load(ema_file, map_location="cpu", weights_only=True) if ema_file.is_file() else None
    acc.wait_for_everyone()
    state_file = decision.path / f"trainer_state_{acc.process_index}.pt"
    if not state_file.is_file():
        state_file = decision.path / "trainer_state_0.pt"
    return torch.load(state_file, weights_only=False), ema


def _steps_as_tensors(optimizer) -> None:
    """A checkpoint saved with offload=cpu (DeepSpeed's CPU Adam) holds each parameter's step as an int; torch's
    Adam and AdamW, which step the same run without offload, require a singleton tensor, and their
    load_state_dict converts nothing. The count is the same; CPU Adam itself takes either."""
    inner = getattr(optimizer, "optimizer", optimizer)  # a ZeRO optimizer wraps the one that steps
    if not isinstance(inner, torch.optim.Optimizer) or type(inner).__module__.startswith("deepspeed."):
        return
    for state in inner.state.values():
        if "step" in state and not torch.is_tensor(state["step"]):
            state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
