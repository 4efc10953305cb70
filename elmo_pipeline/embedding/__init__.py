"""Records to vectors outside Beam: one batch through the model (halving on out-of-memory), the
extract options, and embed-file.
"""
