"""MixLayers: add named task mixes (gamma * softmax(w) . layers) to embedded sentences."""

from __future__ import annotations

from typing import Mapping

import apache_beam as beam

from elmo_pipeline.embedding.batch import apply_mixes, build_mixes
from elmo_pipeline.corpus.records import EmbeddedSentence
from elmo_pipeline.corpus.schema import check_mix_name
from elmo_pipeline.model.scalar_mix import MixSpec, check_spec
from elmo_pipeline.strict import check_ints
from elmo_pipeline.transforms.checks import check_collection, check_element


class _MixFn(beam.DoFn):
    def __init__(self, specs: Mapping[str, MixSpec], n_layers: int) -> None:
        self.specs = dict(specs)
        self.n_layers = n_layers

    def setup(self) -> None:
        self.mixes = build_mixes(self.specs, self.n_layers)

    def process(self, item: EmbeddedSentence):
        check_element("MixLayers", item, EmbeddedSentence)
        yield apply_mixes(item, self.mixes)


@beam.typehints.with_input_types(EmbeddedSentence)
class MixLayers(beam.PTransform):
    """Several mixes in one pass; `specs` maps a column name to its MixSpec (see scalar_mix), each
    of `n_layers` weights (the model's output layers)."""

    def __init__(self, specs: Mapping[str, MixSpec], n_layers: int) -> None:
        super().__init__()
        check_ints(n_layers=n_layers)
        if not isinstance(specs, Mapping):
            raise TypeError(f"specs maps each mix's name to its MixSpec, got a {type(specs).__name__}")
        for name, spec in specs.items():
            # a name no column can take was computed and never written; a mix file's dict (json.load)
            # failed with "'dict' object has no attribute 'weights'"
            if not isinstance(name, str):
                raise TypeError(f"mix name {name!r} is not a str")
            check_mix_name(name)
            check_spec(spec, f"mix {name!r}")
        build_mixes(specs, n_layers)  # a mix with the wrong number of weights fails here, not on a worker
        self.specs = dict(specs)
        self.n_layers = n_layers

    def expand(self, embedded: beam.PCollection) -> beam.PCollection:
        check_collection(self.label, embedded)
        if not self.specs:
            return embedded
        return embedded | beam.ParDo(_MixFn(self.specs, self.n_layers))
