"""data=folder's caption rules: tags shuffled behind the first `keep_tags` (kohya's shuffle_caption and
keep_tokens), as a fixed number of seeded variants per caption that the latent cache holds (frozen encoders
encode each once, before training), and captions replaced by the empty one (caption_dropout)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from zerotune.config.errors import ConfigError
from zerotune.config.schema import Data

DEFAULT_VARIANTS = 4  # data.caption_variants=null with data.shuffle_tags: the cache's size x 4 in text entries


@dataclass(frozen=True)
class CaptionRules:
    shuffle: bool = False
    keep: int = 0             # tags that stay first, in order
    separator: str = ","
    variants: int = 1         # texts cached per caption
    dropout: float = 0.0      # chance a sample trains on the empty caption

    @classmethod
    def of(cls, data: Data) -> CaptionRules:
        variants = (data.caption_variants or DEFAULT_VARIANTS) if data.shuffle_tags else 1
        return cls(bool(data.shuffle_tags), int(data.keep_tags), str(data.tag_separator), int(variants),
                   float(data.caption_dropout))

    def texts(self, caption: str) -> tuple[str, ...]:
        """The caption's variants: itself, or `variants` shuffles of its tags, each seeded by the caption and its
        number (the same texts in every run, so the cache holds them once)."""
        if not self.shuffle:
            return (caption,)
        tags = [t.strip() for t in caption.split(self.separator) if t.strip()]
        kept, rest = tags[:self.keep], tags[self.keep:]
        joiner = self.separator if self.separator.endswith(" ") else self.separator + " "
        seed = int.from_bytes(hashlib.sha256(caption.encode()).digest()[:8], "little")
        return tuple(joiner.join(kept + [rest[i] for i in np.random.default_rng([seed, v]).permutation(len(rest))])
                     for v in range(self.variants))


def check(data: Data) -> None:
    """The caption keys (and data.masked_loss): their values, and that only data=folder has captions (and masks) to
    apply them to."""
    off = {"data.shuffle_tags": "false", "data.caption_dropout": "0", "data.caption_variants": "null",
           "data.keep_tags": "0", "data.masked_loss": "false"}
    changed = [k for k, on in (("data.shuffle_tags", data.shuffle_tags), ("data.caption_dropout", data.caption_dropout),
                               ("data.caption_variants", data.caption_variants is not None),
                               ("data.keep_tags", data.keep_tags), ("data.masked_loss", data.masked_loss)) if on]
    if changed and data.name != "folder":
        what = "images' masks" if changed[0] == "data.masked_loss" else "captions"
        raise ConfigError(changed[0], f"applies to a folder's {what}; data={data.name} has none",
                          f"{changed[0]}={off[changed[0]]}, or data=folder data.path=/path/to/captioned/images")
    p = data.caption_dropout
    if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p < 1:
        raise ConfigError("data.caption_dropout", f"must be a probability from 0 up to 1, got {p!r}",
                          "data.caption_dropout=0.05 (a sample in 20 trains on the empty caption), or 0")
    keep = data.keep_tags
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise ConfigError("data.keep_tags", f"must be a number of tags, 0 or more, got {keep!r}", "data.keep_tags=1")
    if not str(data.tag_separator).strip():
        raise ConfigError("data.tag_separator", "is empty: nothing splits a caption into tags",
                          "data.tag_separator=','")
    variants = data.caption_variants
    if variants is not None:
        if isinstance(variants, bool) or not isinstance(variants, int) or variants < 1:
            raise ConfigError("data.caption_variants", f"must be a whole number of variants, 1 or more, got "
                              f"{variants!r}", f"data.caption_variants={DEFAULT_VARIANTS}")
        if not data.shuffle_tags:
            raise ConfigError("data.caption_variants", "caches shuffles of each caption's tags, and "
                              "data.shuffle_tags is false: every variant would be the caption itself",
                              "data.shuffle_tags=true, or data.caption_variants=null")
