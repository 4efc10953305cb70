"""Loading and saving as methods of the model class, without this package importing it.

`BiLM` inherits `Pretrained`; `BiLM.load(...)` hands `cls` to the format readers, which build
`cls(config, vocab, **kwargs)`. So `formats/` depends on the config and vocabulary only, and the
model depends on `formats/` only through these entry points: no import cycle.
"""

from __future__ import annotations

import os
from typing import Any, TypeVar, Union

from elmo_pipeline.formats import allennlp, formanylangs, native
from elmo_pipeline.formats.files import (CHARS_FILE, CONFIG_FILE, VOCAB_FILE, WEIGHTS_FILE, absolute_local,
                                         allennlp_pair, default_model_location, join_url)
from elmo_pipeline.model.config import ElmoConfig

P = TypeVar("P", bound="Pretrained")
Location = Union[str, "os.PathLike[str]"]  # a path (str or pathlib.Path) or an fsspec URL


class Pretrained:
    @classmethod
    def from_pretrained(cls: type[P], location: Location | None = None, **kwargs: Any) -> P:
        """A model of ours from `location`, a folder (str or Path) or URL holding `config.json` and
        `model.safetensors` (and `vocab.json` or `chars.json` when the model has them); None: the
        embedded default model. `kwargs` go to the class (BiLM's `cache_size` and `kernel`). The
        model is in eval mode, as every loader's: call `.train()` to train it."""
        return _in_eval_mode(native.load_pretrained(cls, _text(location), **kwargs))

    @classmethod
    def from_allennlp(cls: type[P], options: Location, weights: Location, **kwargs: Any) -> P:
        """The original's model from its `options` (options.json) and `weights` (weights.hdf5) files,
        paths or fsspec URLs; `kwargs` as `from_pretrained`'s."""
        return _in_eval_mode(allennlp.load_allennlp(cls, _path(options, "options"), _path(weights, "weights"),
                                                    **kwargs))

    @classmethod
    def from_formanylangs(cls: type[P], location: Location, network_config: Location | None = None,
                          **kwargs: Any) -> P:
        """An ELMoForManyLangs model from `location`, its folder or its archive (.zip, .tar.bz2,
        .tar.xz, .tar.gz, .tar; a path or fsspec URL); `network_config` overrides the network config
        its config.json names; `kwargs` as `from_pretrained`'s."""
        return _in_eval_mode(formanylangs.load_formanylangs(cls, _path(location),
                                                            _text(network_config, "network_config"), **kwargs))

    @classmethod
    def load(cls: type[P], location: Location | None = None, **kwargs: Any) -> P:
        """Either format, by one `location`: a folder or URL of ours (None: the default model), or
        `OPTIONS.json,WEIGHTS.hdf5` for the original's; `kwargs` as `from_pretrained`'s."""
        location = _text(location)
        pair = allennlp_pair(location)
        if pair is not None:
            return cls.from_allennlp(*pair, **kwargs)
        return cls.from_pretrained(location, **kwargs)

    @classmethod
    def config_of(cls, location: Location | None = None) -> ElmoConfig:
        """The config of what `load(location)` would load, reading neither weights nor vocabulary."""
        location = _text(location)
        pair = allennlp_pair(location)
        if pair is not None:
            return allennlp.read_options(*pair)
        return native.read_config(location)

    def save_pretrained(self, directory: Location) -> None:
        """Writes the model in our format into `directory`, a folder (str or Path, made if missing)
        or URL: `model.safetensors`, `vocab.json` or `chars.json` when it has them, then
        `config.json` with the weights' sha256; `from_pretrained(directory)` loads it. Each file is
        written whole under a temporary name and then renamed. An empty `directory` (an unset
        variable) or one that is, or lies under, an existing file is a ValueError."""
        native.save_pretrained(self, _path(directory, "directory"))  # type: ignore[arg-type]


def _in_eval_mode(model: P) -> P:
    """`model` in eval mode: built as an nn.Module, it was in training mode, where `embed` computes
    every word afresh; a user who left out `.eval()` embedded 2.2 times slower, with the same values."""
    model.eval()  # type: ignore[attr-defined]  # every class these readers build is an nn.Module
    return model


def _text(location: Location | None, name: str = "location") -> str | None:
    """A pathlib.Path as its string, a str or None as it is (anything else: `_path`'s TypeError)."""
    return None if location is None else _path(location, name)


def _path(location: Location, name: str = "location") -> str:
    """`location` as a str, a TypeError naming `name` unless it is a str or a path: os.fspath said
    only "expected str, bytes or os.PathLike object, not int", and bytes failed inside fsspec ("a
    bytes-like object is required, not 'str'")."""
    text = os.fspath(location) if isinstance(location, os.PathLike) else location
    if not isinstance(text, str):
        raise TypeError(f"{name} is a path or URL, a str or pathlib.Path; got {location!r:.80}")
    return text


def absolute_model_location(location: str | None) -> str | None:
    """What `load` takes, its local paths made absolute (`absolute_local`); None stays None."""
    pair = allennlp_pair(location)
    if pair is not None:
        return ",".join(absolute_local(path) for path in pair)
    return absolute_local(location) if location is not None else None


def model_files(location: str | None) -> list[str]:
    """The files `load(location)` may read: the original pair, or the files of our folder (the
    default model's for None), so that a command can refuse to write its output over one of them."""
    pair = allennlp_pair(location)
    if pair is not None:
        return list(pair)
    folder = default_model_location() if location is None else location
    return [join_url(folder, name) for name in (CONFIG_FILE, WEIGHTS_FILE, VOCAB_FILE, CHARS_FILE)]
