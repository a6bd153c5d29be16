"""The user's DeepSpeed dict over the generated one: the file's blocks are taken whole."""

from __future__ import annotations


def merge(generated: dict, user: dict) -> dict:
    """Top-level values and blocks: the user's, whole (mixing ours into a block changes what it means: a
    WarmupLR gaining total_num_steps, an Adam block gaining our weight decay). zero_optimization: the user's keys win, and its
    offload_optimizer / offload_param blocks replace ours whole; our keys fill what it leaves out."""
    out = dict(generated)
    for key, value in user.items():
        if key == "zero_optimization" and isinstance(value, dict) and isinstance(out.get(key), dict):
            zero = {k: v for k, v in out[key].items() if not k.startswith("offload_")} \
                if any(k.startswith("offload_") for k in value) else dict(out[key])
            zero.update(value)
            out[key] = zero
        else:
            out[key] = value
    return out
