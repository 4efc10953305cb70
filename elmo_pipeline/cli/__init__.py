"""The `elmo-pipeline` command line: above every other part, and the only library part that
launches Beam pipelines (imported inside each command, so `--help` stays Beam-free).
"""
