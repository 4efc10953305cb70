"""ELMo deep contextualized word representations, as an Apache Beam feature-extraction plugin."""

from typing import TYPE_CHECKING

from elmo_pipeline.exports import lazy_exports

if TYPE_CHECKING:
    from elmo_pipeline.model.bilm import BiLM, CarriedState, Embeddings
    from elmo_pipeline.model.config import ElmoConfig
    from elmo_pipeline.model.scalar_mix import MixSpec, ScalarMix

__version__ = "0.1.0"
__all__ = ["BiLM", "CarriedState", "ElmoConfig", "Embeddings", "MixSpec", "ScalarMix", "__version__"]
if not TYPE_CHECKING:  # a type checker reads the imports above: a name that is none of them is its error
    __getattr__, __dir__ = lazy_exports(__name__, {
        "BiLM": "elmo_pipeline.model.bilm", "CarriedState": "elmo_pipeline.model.bilm",
        "Embeddings": "elmo_pipeline.model.bilm", "ElmoConfig": "elmo_pipeline.model.config",
        "MixSpec": "elmo_pipeline.model.scalar_mix", "ScalarMix": "elmo_pipeline.model.scalar_mix"})
