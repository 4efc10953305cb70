"""ELMo deep contextualized word representations, as an Apache Beam feature-extraction plugin."""

from .bilm import BiLM, CarriedState, Embeddings
from .config import ElmoConfig
from .scalar_mix import ScalarMix

__version__ = "0.1.0"
__all__ = ["BiLM", "CarriedState", "ElmoConfig", "Embeddings", "ScalarMix", "__version__"]
