"""Text to records: input files of every format, spaCy tokenization, the record types and the
Parquet schema.
"""
