"""`zerotune export <checkpoint> <out>`: a checkpoint's full fp32 weights, whatever ZeRO stage saved them
(zero_to_fp32), as diffusers folders and .safetensors; an adapter as diffusers' own LoRA training scripts save it,
optionally merged in by diffusers' fuse/unload."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from zerotune.config.schema import Adapter
from zerotune.models import adapter, backbones, text_encoders
from zerotune.rundir import checkpoints
from zerotune.rundir import checkpoints as manifest
from zerotune.rundir.checkpoint_io import full_state
from zerotune.rundir.checkpoints import read_meta
from zerotune.rundir.summary import RunSummary, Status

if TYPE_CHECKING:
    from diffusers.models.modeling_utils import ModelMixin

WEIGHT_NAME = "pytorch_lora_weights.safetensors"  # diffusers' LORA_WEIGHT_NAME_SAFE
PEFT_WEIGHTS = "adapter_model.safetensors"        # peft's SAFETENSORS_WEIGHTS_NAME


def network_class(config: dict) -> type[ModelMixin]:
    """The diffusers class a checkpoint's config.json names (UNet2DConditionModel, FluxTransformer2DModel, ...)."""
    return backbones.diffusers_class(backbones.family_of_class(config.get("_class_name")).class_name)


def build(config: dict, adapter_cfg: dict, weights: dict):
    """The network with its adapter, holding `weights` (base and adapter, by the module's own names)."""
    network = adapter.add_adapter(network_class(config).from_config(config), Adapter(**adapter_cfg))
    network.load_state_dict(weights, strict=True)
    return network


def build_encoder(name: str, config: dict, adapter_cfg: dict, weights: dict):
    """A trained text encoder with its adapter, holding `weights` (base and adapter, by the module's own names)."""
    from zerotune.models import text_encoders

    encoder = text_encoders.add_adapter(text_encoders.build(name, config), Adapter(**adapter_cfg))
    encoder.load_state_dict(weights, strict=True)
    return encoder


def save(unet_config: dict, adapter_cfg: dict, weights: dict, out: Path, suffix: str, merge: bool,
         encoders: dict[str, tuple[dict, dict]] | None = None) -> dict[str, str]:
    """Write the adapter's folder, <kind>{suffix}/ (lora, loha, lokr), and with `merge` also the network's folder
    (unet{suffix}/ or transformer{suffix}/), its .safetensors and each trained encoder's folder; returns what was
    written. `encoders`: {name: (config, weights)}."""
    unet = build(unet_config, adapter_cfg, weights)
    trained = {name: build_encoder(name, config, adapter_cfg, w) for name, (config, w) in (encoders or {}).items()}
    family = backbones.family_of_class(unet_config.get("_class_name"))
    kind = str(adapter_cfg.get("name", "lora"))
    folder = out / f"{kind}{suffix}"
    if kind == "lora":
        written = {f"lora{suffix}": _save_lora(unet, trained, family, folder)}
    else:
        written = {f"{kind}{suffix}": _save_peft(unet, trained, family.folder, folder)}
    if merge:
        modules = {f"{family.folder}{suffix}": unet, **{f"{name}{suffix}": m for name, m in trained.items()}}
        for name, module in modules.items():
            _merge(module)
            module.save_pretrained(out / name, safe_serialization=True)
            written[name] = str(out / name)
        _save_weights(unet, out / f"{family.folder}{suffix}.safetensors")
    return written


def _save_lora(unet: torch.nn.Module, trained: dict[str, torch.nn.Module], family: backbones.Family,
               folder: Path) -> str:
    """LoRA (DoRA's magnitudes included) as diffusers' LoRA scripts save it: pytorch_lora_weights.safetensors, which
    the pipeline's load_lora_weights reads."""
    import diffusers
    from diffusers.utils import convert_state_dict_to_diffusers

    layers = {f"{name}_lora_layers": convert_state_dict_to_diffusers(adapter.adapter_state_dict(module))
              for name, module in trained.items()}
    metadata = {f"{name}_lora_adapter_metadata": module.peft_config[adapter.ADAPTER_NAME].to_dict()
                for name, module in trained.items()}
    # A classmethod that only prefixes `unet.` / `transformer.` / `text_encoder.` ... and writes the file: for any
    # U-Net SDXL's (it takes both encoders' layers; SD 1.x/2.x read text_encoder's the same way), FluxPipeline's
    # and StableDiffusion3Pipeline's for theirs, whose load_lora_weights read it back.
    lora = adapter.adapter_state_dict(unet)
    getattr(diffusers, family.lora_pipeline).save_lora_weights(
        folder, **{f"{family.folder}_lora_layers": lora if family.lora_peft_names else convert_state_dict_to_diffusers(lora),
                   f"{family.folder}_lora_adapter_metadata": unet.peft_config[adapter.ADAPTER_NAME].to_dict()},
        weight_name=WEIGHT_NAME, **layers, **metadata)
    return str(folder / WEIGHT_NAME)


def _save_peft(unet: torch.nn.Module, trained: dict[str, torch.nn.Module], network: str, folder: Path) -> str:
    """LoHa / LoKr in peft's own format, a folder per module (<network>/, text_encoder/, ...) of
    adapter_config.json and adapter_model.safetensors: what PeftModel.from_pretrained loads (diffusers' LoRA
    loaders take LoRA only)."""
    from safetensors.torch import save_file

    for name, module in {network: unet, **trained}.items():
        (folder / name).mkdir(parents=True, exist_ok=True)
        module.peft_config[adapter.ADAPTER_NAME].save_pretrained(str(folder / name))
        state = {k: v.contiguous() for k, v in adapter.adapter_state_dict(module).items()}
        save_file(state, str(folder / name / PEFT_WEIGHTS), metadata={"format": "pt"})
    return str(folder)


def _merge(module: torch.nn.Module) -> None:
    """The adapter merged into its base weights by peft's own merge, then peft's layers removed."""
    from diffusers.utils.peft_utils import recurse_remove_peft_layers
    from peft.tuners.tuners_utils import BaseTunerLayer

    for layer in module.modules():
        if isinstance(layer, BaseTunerLayer):
            layer.merge(adapter_names=[adapter.ADAPTER_NAME])
    recurse_remove_peft_layers(module)


def _save_weights(module: torch.nn.Module, file: Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in module.state_dict().items()}, str(file))


def find_checkpoint(path: str | Path) -> Path:
    # With checkpoint.dir set elsewhere, a run dir holds no checkpoints/: its summary names them.
    found = checkpoints.find(Path(path)) or next(
        (p for p in _own_checkpoints(Path(path)) if checkpoints.is_complete(p)), None)
    if found is None:
        raise SystemExit(f"zerotune.rundir.export: {path} is not a complete checkpoint and holds none{_why_none(Path(path))}")
    damaged = manifest.problems(found)
    if damaged:
        raise SystemExit(f"zerotune.rundir.export: checkpoint {found} is damaged: {'; '.join(damaged[:3])}")
    return found


def _own_checkpoints(run_dir: Path) -> list[Path]:
    """The checkpoints a run dir's summary says its run saved, final first, then newest first (not
    `last_complete`: in a shared checkpoint.dir the newest may be another run's)."""
    summary = RunSummary.read_if_whole(run_dir)
    record = (summary.checkpoint if summary is not None else None) or {}
    paths = [record.get("final"), *(s.get("path") for s in reversed(record.get("saved") or []))]
    return [Path(p) for p in paths if p]


def _why_none(run_dir: Path) -> str:
    """For a run dir: why its run left no checkpoint, from its summary."""
    summary = RunSummary.read_if_whole(run_dir)
    if summary is None or not summary.as_dict():
        return ""
    # The word as written (its repr goes into the message): an older file's unknown word too.
    status = str(summary.status) if summary.status is not None else summary.extra.get("status")
    named = _own_checkpoints(run_dir)
    if named:
        return f" (its run's checkpoint {named[0]} is no longer complete)"
    if status == Status.OK:
        return " (its run saved none: checkpoint.final=false and no checkpoint.every_n_steps)"
    return f" (its run ended with status {status!r} before any checkpoint was saved)"


def _save(config: dict, weights: dict, out: Path, name: str) -> Path:
    from safetensors.torch import save_file

    unet = network_class(config).from_config(config)
    unet.load_state_dict(weights, strict=True)
    unet.save_pretrained(out / name, safe_serialization=True)
    save_file({k: v.contiguous() for k, v in unet.state_dict().items()}, str(out / f"{name}.safetensors"))
    return out / name


def _save_encoder(name: str, config: dict, weights: dict, out: Path, folder: str) -> Path:
    encoder = text_encoders.build(name, config)
    encoder.load_state_dict(weights, strict=True)
    encoder.save_pretrained(out / folder, safe_serialization=True)
    return out / folder


def split_modules(weights: dict, names: tuple[str, ...]) -> dict[str, dict]:
    """A checkpoint of the U-Net with trained text encoders holds `unet.`, `text_encoder.` ... keys: by module."""
    if not names:
        return {"unet": weights}
    parts: dict[str, dict] = {name: {} for name in ("unet", *names)}
    for key, value in weights.items():
        module, _, rest = key.partition(".")
        parts[module][rest] = value
    return parts


def export(checkpoint: str | Path, out: str | Path, merge: bool = False) -> dict[str, str]:
    """Write the checkpoint's weights into `out`: unet/ + unet.safetensors (a transformer's: transformer/ +
    transformer.safetensors) and each trained text encoder's <name>/,
    or under adapter=lora lora/pytorch_lora_weights.safetensors (encoders' adapters under `text_encoder.` /
    `text_encoder_2.`), with `merge` also the merged unet/ and encoders; `*_ema` twins when the run kept an EMA.
    `checkpoint` may be a run dir or checkpoint dir (its newest complete checkpoint, or the one its summary names).
    Returns {what: its path}: the checkpoint, then each part written."""
    path, out = find_checkpoint(checkpoint), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    meta = read_meta(path)
    config, adapter_cfg = checkpoints.unet_config(path), meta.get("adapter_config")
    names = text_encoders.CHOICES[str(meta.get("train_text_encoder", "none"))]
    encoder_configs = {n: json.loads((path / n / "config.json").read_text()) for n in names}
    weights, _, _ = full_state(path, with_optimizer=False)
    parts = split_modules({k: v.float() for k, v in weights.items()}, names)
    ema_parts = None
    if (path / checkpoints.EMA_FILE).is_file():
        ema = torch.load(path / checkpoints.EMA_FILE, map_location="cpu", weights_only=True)["shadow"]
        ema_parts = split_modules(ema, names)
    written = {"checkpoint": str(path)}
    runs = [("", parts)] + ([("_ema", {n: {**parts[n], **ema_parts.get(n, {})} for n in parts})]
                            if ema_parts is not None else [])
    for suffix, modules in runs:
        if adapter_cfg is None:
            name = backbones.family_of_class(config.get("_class_name")).folder + suffix  # unet or transformer
            written[name] = str(_save(config, modules["unet"], out, name))
            for n in names:
                written[f"{n}{suffix}"] = str(_save_encoder(n, encoder_configs[n], modules[n], out, f"{n}{suffix}"))
        else:  # the averaged adapter weights over the same frozen base
            written.update(save(config, adapter_cfg, modules["unet"], out, suffix, merge,
                                            {n: (encoder_configs[n], modules[n]) for n in names}))
    return written
