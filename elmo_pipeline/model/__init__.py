"""The network: character encoder, biLSTM (one reference step, fast kernels held to it), the biLM,
scalar mixes and LM heads. Imports nothing above it; loading comes from `formats/` through the
`Pretrained` mixin.
"""
