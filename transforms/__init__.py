"""Apache Beam transforms of the feature-extraction pipeline: thin layers over the library modules.

Installed as `elmo_pipeline.transforms`.
"""

from elmo_pipeline.transforms.data_plane import keep_elements_whole

keep_elements_whole()  # any of our transforms in a multi_threading job: see data_plane.py
