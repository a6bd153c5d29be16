"""The validation prompts (validation.prompts, validation.prompt_file), each with its seed, negative prompt and size,
checked before any model exists; the passes run in train/validation.py. A prompt file is `.txt` (kohya's
sample_prompts: `--n` negative, `--d` seed, `--w`/`--h`, `--l` guidance, `--s` steps), `.jsonl` ({"prompt", ...}
per line) or `.json` (SimpleTuner's {name: prompt} library, or a list of prompts or such objects)."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerotune.config.errors import ConfigError
from zerotune.config.schema import Config, Model, Validation
from zerotune.models.backbones import backbone_of

WEIGHTS = ("auto", "model", "ema", "comparison")
# kohya's per-prompt options (library/train_util.py sample_images): the letter and the field it sets.
_KOHYA = {"n": "negative_prompt", "d": "seed", "w": "width", "h": "height", "l": "guidance_scale", "s": "steps"}
_FIELDS = {"prompt", "negative_prompt", "seed", "width", "height", "guidance_scale", "steps", "name"}
_OPTION = re.compile(r"\s--(\w+)\s*")


@dataclass(frozen=True)
class ValidationPrompt:
    name: str                 # file stem and W&B key (validation/<name>): the same at every pass
    prompt: str
    negative_prompt: str      # "": the null condition (zeros), as training's condition dropout
    seed: int
    width: int
    height: int
    guidance_scale: float
    steps: int


def enabled(cfg: Config) -> bool:
    return bool(cfg.validation.prompts) or bool(cfg.validation.prompt_file)


def check_validation(cfg: Config) -> list[ValidationPrompt]:
    """Every validation key and prompt, before training; [] when there are no prompts (validation off)."""
    v = cfg.validation
    if not enabled(cfg):
        return []
    if cfg.model.conditioning == "class":
        raise ConfigError("validation.prompts", f"model={cfg.model.name} is class-conditional: it takes no text "
                          "prompt (its grid per class is sampled by evaluate.*)",
                          "validation.prompts=[] validation.prompt_file=null, or a text model: model=sdxl_tiny "
                          "data=folder data.path=/path/to/images model.components=/path/to/sdxl_pipeline")
    if not (cfg.model.components or cfg.model.vae):
        folders = ", ".join(f"{name}/" for name in backbone_of(cfg.model).components())
        raise ConfigError("model.components", "validation prompts are encoded by the text encoders and decoded by "
                          "the VAE, and no local folder holds them",
                          f"model.components=/path/to/a/local/{cfg.model.name}/pipeline (with {folders})")
    _check_numbers(v)
    if v.weights not in WEIGHTS:
        raise ConfigError("validation.weights", f"must be one of {', '.join(WEIGHTS)}, got {v.weights!r}",
                          "validation.weights=auto")
    if v.weights in ("ema", "comparison") and not cfg.ema.enabled:
        raise ConfigError("validation.weights", f"{v.weights} samples with the EMA's weights, but ema.enabled=false",
                          "ema.enabled=true, or validation.weights=model")
    prompts = load_prompts(v, _default_size(cfg))
    for p in prompts:
        _check_size(cfg.model, p)
    return prompts


def weights_to_sample(cfg: Config) -> tuple[str, ...]:
    """("model",), ("ema",) or both, in the grid's column order."""
    choice = cfg.validation.weights
    if choice == "auto":
        choice = "ema" if cfg.ema.enabled and cfg.ema.use_for_samples else "model"
    return ("model", "ema") if choice == "comparison" else (str(choice),)


def load_prompts(v: Validation, size: tuple[int, int]) -> list[ValidationPrompt]:
    """validation.prompts, then the file's, each with its seed (validation.seed + its index unless it names one)."""
    rows: list[dict[str, Any]] = [{"prompt": _text(p, "validation.prompts")} for p in v.prompts]
    if v.prompt_file:
        rows += _read_file(Path(str(v.prompt_file)).expanduser())
    width, height = size
    defaults = {"negative_prompt": str(v.negative_prompt), "width": width, "height": height,
                "guidance_scale": float(v.guidance_scale), "steps": int(v.steps)}
    out, names = [], set()
    for i, row in enumerate(rows):
        name = _slug(str(row.pop("name", "")) or f"{i:02d}-{row['prompt']}")
        if name in names:
            name = f"{i:02d}-{name}"
        names.add(name)
        seed = row.pop("seed", None)
        out.append(ValidationPrompt(name=name, seed=int(v.seed) + i if seed is None else int(seed),
                                    **{**defaults, **row}))
    return out


def _check_numbers(v: Validation) -> None:
    def integer(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    if not integer(v.every_n_steps) or v.every_n_steps < 0:
        raise ConfigError("validation.every_n_steps", f"must be 0 (start and end only) or a positive number of "
                          f"optimizer steps, got {v.every_n_steps!r}", "validation.every_n_steps=100")
    if not integer(v.steps) or v.steps < 1:
        raise ConfigError("validation.steps", f"must be a positive number of sampling steps, got {v.steps!r}",
                          "validation.steps=20")
    if not integer(v.seed) or v.seed < 0:
        raise ConfigError("validation.seed", f"must be a non-negative integer, got {v.seed!r}", "validation.seed=0")
    if isinstance(v.guidance_scale, bool) or not isinstance(v.guidance_scale, (int, float)) or v.guidance_scale < 0:
        raise ConfigError("validation.guidance_scale", f"must be a number >= 0 (1 or less: no guidance), got "
                          f"{v.guidance_scale!r}", "validation.guidance_scale=5")
    if not 0 <= float(v.guidance_rescale) <= 1:
        raise ConfigError("validation.guidance_rescale", f"must be from 0 to 1, got {v.guidance_rescale!r}",
                          "validation.guidance_rescale=0.7 (with zero terminal SNR), or 0")


def _default_size(cfg: Config) -> tuple[int, int]:
    """(width, height): validation.resolution, else the run's square resolution.size."""
    value = cfg.validation.resolution
    if value is None:
        return cfg.resolution.size, cfg.resolution.size
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value, value
    if isinstance(value, Sequence) and not isinstance(value, str) and len(value) == 2 and all(
            isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in value):
        return int(value[0]), int(value[1])
    raise ConfigError("validation.resolution", f"must be null (the run's), a side in pixels or [width, height], "
                      f"got {value!r}", f"validation.resolution={cfg.resolution.size}")


def _check_size(model: Model, p: ValidationPrompt) -> None:
    net = backbone_of(model)
    unit = net.size_unit()
    for side, value in (("width", p.width), ("height", p.height)):
        if value <= 0 or value % unit:
            fit = max(unit, round(value / unit) * unit)
            raise ConfigError("validation.resolution", f"prompt {p.name!r}: a {side} of {value} px is not a multiple "
                              f"of {unit} (model={model.name} encodes by {model.vae_scale_factor} and "
                              f"{net.size_reason()})", f"validation.resolution={fit} (and --w/--h in the prompt file "
                              f"multiples of {unit})")
    if p.steps < 1 or p.guidance_scale < 0:
        raise ConfigError("validation.prompt_file", f"prompt {p.name!r}: steps {p.steps} and guidance scale "
                          f"{p.guidance_scale} must be >= 1 and >= 0", "--s 20 --l 5 on its line, or neither")


def _text(value: Any, key: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(key, f"a prompt must be non-empty text, got {value!r}",
                          'validation.prompts=["a photo of a dog"]')
    return value.strip()


def _read_file(path: Path) -> list[dict[str, Any]]:
    key = "validation.prompt_file"
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(key, f"cannot read {path} ({exc})", "validation.prompt_file=/path/to/prompts.txt "
                          "(a prompt per line), or validation.prompt_file=null") from None
    rows = {".json": _json_rows, ".jsonl": _jsonl_rows}.get(path.suffix.lower(), _kohya_rows)(text, path)
    if not rows:
        raise ConfigError(key, f"{path} holds no prompt", "a prompt per line, or validation.prompt_file=null")
    return rows


def _kohya_rows(text: str, path: Path) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = _OPTION.split(" " + line)
        row: dict[str, Any] = {"prompt": parts[0].strip()}
        for letter, value in zip(parts[1::2], parts[2::2], strict=True):
            if letter not in _KOHYA:
                raise ConfigError("validation.prompt_file", f"{path} line {number}: --{letter} is not an option "
                                  f"validation takes (it takes {', '.join('--' + k for k in _KOHYA)})",
                                  f"remove '--{letter} {value.strip()}' from line {number}")
            row[_KOHYA[letter]] = _typed(_KOHYA[letter], value.strip(), f"{path} line {number}")
        if not row["prompt"]:
            raise ConfigError("validation.prompt_file", f"{path} line {number} has options but no prompt",
                              f"put the prompt first on line {number}, or delete the line")
        rows.append(row)
    return rows


def _jsonl_rows(text: str, path: Path) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(_object(json.loads(line), f"{path} line {number}"))
            except ValueError as exc:
                raise ConfigError("validation.prompt_file", f"{path} line {number} is not JSON ({exc})",
                                  f'line {number} as {{"prompt": "a photo of a dog"}}') from None
    return rows


def _json_rows(text: str, path: Path) -> list[dict[str, Any]]:
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ConfigError("validation.prompt_file", f"{path} is not JSON ({exc})",
                          '{"dog": "a photo of a dog"} (name: prompt), or a .txt with a prompt per line') from None
    if isinstance(data, dict):
        return [{"name": str(name), "prompt": _text(prompt, f"validation.prompt_file ({path}: {name})")}
                for name, prompt in data.items()]
    if isinstance(data, list):
        return [{"prompt": _text(item, f"validation.prompt_file ({path})")} if isinstance(item, str)
                else _object(item, f"{path} item {i}") for i, item in enumerate(data)]
    raise ConfigError("validation.prompt_file", f"{path} holds a {type(data).__name__}, not prompts",
                      '{"dog": "a photo of a dog"}, or a list of prompts')


def _object(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict) or "prompt" not in item:
        raise ConfigError("validation.prompt_file", f"{where}: expected an object with a \"prompt\", got {item!r}",
                          '{"prompt": "a photo of a dog", "seed": 1}')
    unknown = sorted(set(item) - _FIELDS)
    if unknown:
        raise ConfigError("validation.prompt_file", f"{where}: unknown field {unknown[0]!r} (known: "
                          f"{', '.join(sorted(_FIELDS))})", f"remove {unknown[0]!r} from it")
    row = {"prompt": _text(item["prompt"], f"validation.prompt_file ({where})")}
    row.update({k: _typed(k, v, where) for k, v in item.items() if k != "prompt"})
    return row


def _typed(field: str, value: Any, where: str) -> Any:
    kind = {"seed": int, "width": int, "height": int, "steps": int, "guidance_scale": float}.get(field, str)
    try:
        if kind is int and (isinstance(value, bool) or (isinstance(value, float) and not value.is_integer())):
            raise ValueError
        return kind(value)
    except (TypeError, ValueError):
        raise ConfigError("validation.prompt_file", f"{where}: {field} must be {kind.__name__}, got {value!r}",
                          f"a {kind.__name__} for {field}") from None


def _slug(text: str) -> str:
    """A file- and W&B-key-safe name: lowercase words joined by '-', at most 48 characters."""
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return slug[:48].rstrip("-") or "prompt"
