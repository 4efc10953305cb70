"""ELMo deep contextualized word representations, as an Apache Beam feature-extraction plugin."""

from elmo_pipeline.model.bilm import BiLM, CarriedState, Embeddings
from elmo_pipeline.model.config import ElmoConfig
from elmo_pipeline.model.scalar_mix import MixSpec, ScalarMix

__version__ = "0.1.0"
__all__ = ["BiLM", "CarriedState", "ElmoConfig", "Embeddings", "MixSpec", "ScalarMix", "__version__"]
