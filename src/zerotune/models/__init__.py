"""The denoising network's construction (models/backbones.py names its family): from an architecture config (random
init) or a local pretrained path, and its sizes from a meta-device build."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from zerotune.config import files
from zerotune.config.errors import ConfigError
from zerotune.config.schema import Adapter, Model
from zerotune.models import adapter
from zerotune.models import weights as single_file
from zerotune.models.backbones import backbone_of, is_transformer
from zerotune.models.weights import (
    compare_shapes,
    found_network_folder,
    network_folder,
    read_folder,
    read_shapes,
)

if TYPE_CHECKING:
    from diffusers.models.modeling_utils import ModelMixin


@dataclass(frozen=True)
class ModelStats:
    """What the DeepSpeed dict builder needs to know about the model, measured on a meta-device copy."""

    num_params: int
    largest_param_numel: int
    param_numels: tuple[int, ...] = ()   # in model.parameters() order: what DeepSpeed partitions
    trainable_numels: tuple[int, ...] = ()  # those the optimizer gets, in the same order (all without an adapter)
    adapter_target_numel: int = 0  # the adapted modules' own weights: gathered whole while peft wraps them at ZeRO-3
    trainable_shapes: tuple[tuple[int, ...], ...] = ()  # the trainable ones' shapes (Adafactor factors by shape)
    # how many trainable parameters each optimizer parameter group holds: the U-Net's, then each trained text
    # encoder's (model.train_text_encoder); () for one group
    trainable_groups: tuple[int, ...] = ()

    def module_numels(self) -> list[list[int]]:
        """Each trained module's trainable parameters' sizes: the U-Net's, then each trained text encoder's."""
        numels = list(self.trainable_numels) or list(self.param_numels)
        out, start = [], 0
        for count in self.trainable_groups or (len(numels),):
            out.append(numels[start:start + count])
            start += count
        return out

    def trained_shapes(self) -> list[tuple[int, ...]] | None:
        """The trainable parameters' shapes, or None where these stats predate them."""
        return [tuple(s) for s in self.trainable_shapes] or None

    @property
    def num_trainable(self) -> int:
        return sum(self.trainable_numels) if self.trainable_numels else self.num_params

    @property
    def num_frozen(self) -> int:
        return self.num_params - self.num_trainable


def stats_from_json(data: dict[str, Any]) -> ModelStats:
    """ModelStats from its JSON (lists back to tuples, the shapes' too)."""
    values: dict[str, Any] = {**{k: tuple(v) if isinstance(v, list) else v for k, v in data.items()},
                              "trainable_shapes": tuple(tuple(s) for s in data.get("trainable_shapes", ()))}
    return ModelStats(**values)


def unet_config(model_cfg: Model) -> dict:
    return OmegaConf.to_container(model_cfg.unet, resolve=True) if not isinstance(model_cfg.unet, dict) \
        else dict(model_cfg.unet)


def downsample_factor(model_cfg: Model) -> int:
    """How many latent pixels the network takes as one: a U-Net's 2 ** halvings, a transformer's patch side."""
    return backbone_of(model_cfg).size_unit() // int(model_cfg.vae_scale_factor)


def latent_shape(model_cfg: Model, size: int) -> tuple[int, int, int]:
    """(channels, height, width) of the network's input at pixel side `size`; refuses sizes it cannot take."""
    net = backbone_of(model_cfg)
    vae, unit = int(model_cfg.vae_scale_factor), net.size_unit()
    if not isinstance(size, int) or size <= 0:
        raise ConfigError("resolution.size", f"must be a positive integer, got {size!r}", "resolution=1024")
    if size % unit:
        ok = [s for s in (size - size % unit, size + unit - size % unit) if s > 0]
        raise ConfigError("resolution.size", f"{size} px is not divisible by {unit}: model "
                          f"{model_cfg.name} encodes by {vae} and {net.size_reason()}",
                          f"resolution.size={' or '.join(map(str, ok))}")
    return net.latent_channels(), size // vae, size // vae


def _from_config(model_cfg: Model):
    net = backbone_of(model_cfg)
    return net.model_class()(**net.arguments())


def model_stats(model_cfg: Model, adapter_cfg: Adapter | None = None) -> ModelStats:
    """Parameter counts from a meta-device build, with its adapter if any: no memory, no weights.

    Cached per architecture: building it imports diffusers' whole model zoo (about 2 s and 300 MiB), which
    the job's parent would otherwise pay at every start just to count."""
    file = files.cache_dir("models") / f"stats-{_stats_key(model_cfg, adapter_cfg)}.json"
    cached = files.read_json(file)
    if isinstance(cached, dict) and set(cached) == {f.name for f in fields(ModelStats)}:
        return stats_from_json(cached)
    stats = _measure_stats(model_cfg, adapter_cfg)
    files.write_cached_json(file, asdict(stats))
    return stats


def _stats_key(model_cfg: Model, adapter_cfg: Adapter | None) -> str:
    """The architecture, the adapter, and the versions of the libraries that build them."""

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    what: dict[str, Any] = {"unet": unet_config(model_cfg), "adapter": adapter.settings(adapter_cfg),
            "text_encoders": trained_encoder_archs(model_cfg),
            "versions": [installed(name) for name in ("diffusers", "peft", "torch", "transformers")], "format": 4}
    if is_transformer(model_cfg):  # absent for U-Nets: their cached stats keep their keys
        what.update(backbone=model_cfg.backbone, transformer=backbone_of(model_cfg).arguments())
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def trained_encoder_archs(model_cfg: Model) -> dict[str, dict]:
    """{name: architecture} of the text encoders the run trains (model.train_text_encoder), none by default."""
    from zerotune.models import text_encoders
    from zerotune.models import text_encoders as encoder_archs

    names = text_encoders.trained(model_cfg)
    if not names:
        return {}
    found = encoder_archs.configs(model_cfg)
    if found is None:
        raise ConfigError("model.components", f"model.train_text_encoder={model_cfg.train_text_encoder} trains "
                          f"text encoders whose architecture model={model_cfg.name} does not name",
                          f"model.components=/path/to/a/local/{model_cfg.name}/pipeline")
    return {name: found[0][name] for name in names}


def _measure_stats(model_cfg: Model, adapter_cfg: Adapter | None) -> ModelStats:
    """Counted in the engine module's parameters() order: the U-Net's, then each trained text encoder's."""
    from accelerate import init_empty_weights

    from zerotune.models import text_encoders

    with init_empty_weights():
        unet = _from_config(model_cfg)
        targets = adapter.targeted_modules(unet, adapter_cfg)
        unet = adapter.add_adapter(unet, adapter_cfg)
    modules = [unet]
    for name, arch in trained_encoder_archs(model_cfg).items():
        encoder = text_encoders.build_meta(name, arch)
        targets += adapter.targeted_modules(encoder, adapter_cfg, text_encoders.encoder_targets(adapter_cfg))
        with init_empty_weights():
            modules.append(text_encoders.add_adapter(encoder, adapter_cfg))
    target_numel = sum(p.numel() for m in targets for p in m.parameters(recurse=False))
    params = [p for m in modules for p in m.parameters()]
    numels = [p.numel() for p in params]
    trained = [p for p in params if p.requires_grad]
    groups = tuple(sum(1 for p in m.parameters() if p.requires_grad) for m in modules) if len(modules) > 1 else ()
    return ModelStats(num_params=sum(numels), largest_param_numel=max(numels), param_numels=tuple(numels),
                      trainable_numels=tuple(p.numel() for p in trained), adapter_target_numel=target_numel,
                      trainable_shapes=tuple(tuple(p.shape) for p in trained), trainable_groups=groups)


def build_network(model_cfg: Model, zero_init=None):
    """The network (its family: models/backbones.py) from `model.pretrained` (a diffusers folder, a .safetensors
    state dict in diffusers' names, or a U-Net's original-layout single-file checkpoint) or from its config.

    `zero_init`: a `deepspeed.zero.Init` context (ZeRO-3), under which each module's parameters are partitioned
    as it is built and the weights are loaded into the partitions (models/weights.py)."""
    pretrained = model_cfg.pretrained
    if zero_init is not None:
        unet = _build_partitioned(model_cfg, zero_init, Path(str(pretrained)).expanduser() if pretrained else None)
    elif not pretrained:
        unet = _from_config(model_cfg)
    else:
        unet = load_pretrained(model_cfg, Path(str(pretrained)).expanduser())
    if model_cfg.attention == "sdpa":
        from diffusers.models.attention_processor import AttnProcessor2_0

        unet.set_attn_processor(AttnProcessor2_0())
    return unet


def _build_partitioned(model_cfg: Model, zero_init, path: Path | None):
    # Imported before zero.Init is entered: diffusers' first import creates tensors, which zero.Init's patched
    # tensor constructors would take.
    from diffusers.models.modeling_utils import no_init_weights

    from zerotune.models import weights as partitioned

    net = backbone_of(model_cfg)
    net.model_class()  # diffusers' import, before zero.Init
    if path is None:
        return partitioned.build(lambda: _from_config(model_cfg), zero_init, None, "")
    config, weight_files = _pretrained_files(model_cfg, path)
    if is_single_file(path):
        weights: partitioned.Weights = partitioned.ConvertedWeights(path, config)
    elif not path.is_dir():  # a .safetensors state dict: built as load_pretrained builds it
        return partitioned.build(lambda: _from_config(model_cfg), zero_init,
                                 partitioned.FileWeights(weight_files), str(path))
    else:  # .bin weights: read_folder only looks for them
        weights = partitioned.FileWeights(weight_files or _bin_files(found_network_folder(path, net.folder)))

    def make_unet():
        # As from_pretrained and from_single_file build it: torch.nn.init's functions skipped, since the files
        # replace every weight. So the build draws nothing from the global RNG, and what draws next (peft's LoRA
        # init, the data) draws what it does after them at the other stages.
        with no_init_weights():
            return net.model_class().from_config(config)

    unet = partitioned.build(make_unet, zero_init, weights, str(path))
    return unet.eval()  # as from_pretrained leaves it


def is_single_file(path: Path) -> bool:
    """Whether `path` is an original-layout single-file checkpoint (read from its header alone)."""
    return path.suffix == ".safetensors" and path.is_file() and single_file.is_original_layout(read_shapes(path))


def _bin_files(folder: Path) -> list[Path]:
    from diffusers.utils import constants as names

    index = folder / names.WEIGHTS_INDEX_NAME
    if index.is_file():
        return [folder / shard for shard in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [folder / names.WEIGHTS_NAME]


def load_pretrained(model_cfg: Model, path: Path):
    from safetensors.torch import load_file

    net = backbone_of(model_cfg)
    config, _ = _pretrained_files(model_cfg, path)
    if path.is_dir():
        return net.model_class().from_pretrained(network_folder(path, net.folder), local_files_only=True)
    if is_single_file(path):  # its architecture checked by preflight's check_pretrained, from the header
        return single_file.load(path, config)
    unet = _from_config(model_cfg)
    missing, unexpected = unet.load_state_dict(load_file(str(path)), strict=False)
    if missing or unexpected:
        raise ConfigError("model.pretrained", f"{path} does not match model={model_cfg.name}: {len(missing)} missing "
                          f"keys (e.g. {missing[:2]}), {len(unexpected)} unexpected (e.g. {unexpected[:2]})",
                          "choose the model option whose architecture the weights were saved from")
    return unet


def _pretrained_files(model_cfg: Model, path: Path) -> tuple[dict, list[Path]]:
    """The network's config and safetensors files `model.pretrained` names: a diffusers folder's own (one without
    a config or weights is refused, saying which), or the model option's config for a single .safetensors (a state
    dict in diffusers' names, or a U-Net's original-layout checkpoint)."""
    net = backbone_of(model_cfg)
    if path.is_dir():
        return read_folder(path, net.folder)
    if path.suffix == ".safetensors" and path.is_file():
        return net.arguments(), [path]
    problem = "does not exist" if not path.exists() else "is neither a diffusers folder nor a .safetensors file"
    raise ConfigError("model.pretrained", f"{path} {problem}",
                      "model.pretrained=/path/to/unet_folder, /path/to/unet.safetensors or /path/to/checkpoint.safetensors")


def check_pretrained(model_cfg: Model) -> None:
    """What `load_pretrained` needs, checked in seconds without reading a tensor: the path exists, a folder
    has a U-Net config and weights, and every safetensors header is whole and names the tensors (and shapes)
    of the U-Net it loads into: a folder's own config.json, or the model option's for a single file. An
    original-layout checkpoint's names and shapes are those diffusers' conversion makes of its header."""
    if not model_cfg.pretrained:
        return
    path = Path(str(model_cfg.pretrained)).expanduser()
    config, weight_files = _pretrained_files(model_cfg, path)
    net = backbone_of(model_cfg)
    model = f"the {net.class_name} its config.json describes" if path.is_dir() else f"model={model_cfg.name}"
    found = {name: shape for file in weight_files for name, shape in read_shapes(file).items()}
    if single_file.is_original_layout(found):
        try:
            compare_shapes(path, single_file.converted_shapes(found, config, path), _meta_shapes(config, path), model)
        except ConfigError as err:
            matching = _options_holding(found, path)
            raise ConfigError(err.key, err.problem, f"model={matching[0]} (its U-Net is that option's)" if matching
                              else single_file.WRONG_MODEL_FIX) from None
    elif weight_files:
        compare_shapes(weight_files[0] if len(weight_files) == 1 else path, found,
                       _meta_shapes(config, path, net.model_class()), model)


def _meta_shapes(config: dict, path: Path, model_class: type[ModelMixin] | None = None) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the network `config` describes (a U-Net unless `model_class` says), on the meta device."""
    from accelerate import init_empty_weights
    from diffusers import UNet2DConditionModel

    model_class = model_class or UNet2DConditionModel
    try:
        with init_empty_weights():
            unet = model_class.from_config(config)
    except (TypeError, ValueError) as exc:
        raise ConfigError("model.pretrained", f"{path}'s config.json does not describe a "
                          f"{model_class.__name__} ({exc})", f"point model.pretrained at a {model_class.__name__}'s "
                          "folder") from None
    return {name: tuple(tensor.shape) for name, tensor in unet.state_dict().items()}


def load_option(path: Path) -> Model:
    """A model option's file (conf/model/<name>.yaml, or the user's) as the schema's Model, the other keys at
    their defaults."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Model), OmegaConf.load(path)))  # type: ignore[return-value]


def _options_holding(header: dict[str, tuple[int, ...]], path: Path) -> list[str]:
    """The model options whose U-Net an original-layout checkpoint holds: converted, its names and shapes are
    the option's. Only asked once a checkpoint has been refused, to name the fix."""
    from zerotune.config import search as config_search

    search = config_search.current()
    holding = []
    for name in search.group_options().get("model", []):
        file = search.option_file("model", name)
        if file is None:
            continue
        try:
            config = unet_config(load_option(file))
            if single_file.converted_shapes(header, config, path) == _meta_shapes(config, path):
                holding.append(name)
        except (ConfigError, OmegaConfBaseException, ValueError, TypeError, KeyError):
            continue  # an option of the user's that composes only with its defaults: not a candidate here
    return holding
