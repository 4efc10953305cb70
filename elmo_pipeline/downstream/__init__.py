"""Offline downstream training from the Parquet features of `extract`.

- `dataset`: stream Parquet shards (local or fsspec URLs) into PyTorch as padded sentence batches.
- `mix`: a trainable task mix (softmax weights, gamma, L2 penalty, dropout) and `[x_k ; ELMo_k]`.
- `conll`: labelled token files (CoNLL-U, CoNLL-2003 columns).
- `probe`: per-token linear probes on each layer and on a learned mix.
- `similarity`: one word in several sentences, cosine similarity per layer (polysemy).
"""

from elmo_pipeline.downstream.dataset import FeatureBatch, ParquetFeatureDataset
from elmo_pipeline.downstream.mix import ElmoConcat, TrainableMix, concat_elmo

__all__ = ["ElmoConcat", "FeatureBatch", "ParquetFeatureDataset", "TrainableMix", "concat_elmo"]
