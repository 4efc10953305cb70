"""Apache Beam transforms of the feature-extraction pipeline: thin layers over the library modules.

Installed as `elmo_pipeline.transforms`.
"""
