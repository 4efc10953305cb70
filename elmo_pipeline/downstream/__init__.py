"""Offline downstream training from the Parquet features of `extract`.

- `dataset`: stream Parquet shards (local or fsspec URLs) into PyTorch as padded sentence batches.
- `mix`: a trainable task mix (softmax weights, gamma, L2 penalty, dropout) and `[x_k ; ELMo_k]`.
- `conll`: labelled token files (CoNLL-U, CoNLL-2003 columns).
- `probe`: per-token linear probes on each layer and on a learned mix.
- `similarity`: one word in several sentences, cosine similarity per layer (polysemy).
"""

from typing import TYPE_CHECKING

from elmo_pipeline.exports import lazy_exports

if TYPE_CHECKING:
    from elmo_pipeline.downstream.dataset import FeatureBatch, ParquetFeatureDataset
    from elmo_pipeline.downstream.mix import ElmoConcat, TrainableMix, concat_elmo

__all__ = ["ElmoConcat", "FeatureBatch", "ParquetFeatureDataset", "TrainableMix", "concat_elmo"]
if not TYPE_CHECKING:  # a type checker reads the imports above: a name that is none of them is its error
    __getattr__, __dir__ = lazy_exports(__name__, {
        "FeatureBatch": "elmo_pipeline.downstream.dataset", "ParquetFeatureDataset": "elmo_pipeline.downstream.dataset",
        "ElmoConcat": "elmo_pipeline.downstream.mix", "TrainableMix": "elmo_pipeline.downstream.mix",
        "concat_elmo": "elmo_pipeline.downstream.mix"})
