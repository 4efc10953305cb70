"""Records to vectors outside Beam: one batch through the model (halving on out-of-memory), the
extract options, and embed-file.
"""

# padded tokens per model call, <S>/</S> included: extract's and embed-file's default
DEFAULT_BATCH_TOKENS = 8192
# embed-file's longest line: one sentence costs some 60 KB a token with the default model (the
# LSTM pads a call to 16 rows), so about 600 MB
DEFAULT_MAX_SENTENCE_TOKENS = 10_000
