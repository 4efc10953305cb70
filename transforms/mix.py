"""MixLayers: add named task mixes (gamma * softmax(w) . layers) to embedded sentences."""

from __future__ import annotations

from typing import Mapping

import apache_beam as beam

from elmo_pipeline.embedding.batch import apply_mixes, build_mixes
from elmo_pipeline.corpus.records import EmbeddedSentence
from elmo_pipeline.model.scalar_mix import MixSpec


class _MixFn(beam.DoFn):
    def __init__(self, specs: Mapping[str, MixSpec], n_layers: int) -> None:
        self.specs = dict(specs)
        self.n_layers = n_layers

    def setup(self) -> None:
        self.mixes = build_mixes(self.specs, self.n_layers)

    def process(self, item: EmbeddedSentence):
        yield apply_mixes(item, self.mixes)


class MixLayers(beam.PTransform):
    """Several mixes in one pass; `specs` maps a column name to its MixSpec (see scalar_mix)."""

    def __init__(self, specs: Mapping[str, MixSpec], n_layers: int) -> None:
        super().__init__()
        build_mixes(specs, n_layers)  # a mix with the wrong number of weights fails here, not on a worker
        self.specs = dict(specs)
        self.n_layers = n_layers

    def expand(self, embedded: beam.PCollection) -> beam.PCollection:
        if not self.specs:
            return embedded
        return embedded | beam.ParDo(_MixFn(self.specs, self.n_layers))
