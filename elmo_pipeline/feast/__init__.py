"""A Feast feature repository over the Parquet output of `extract`."""
