"""Preparing corpora, pretraining and fine-tuning the biLM, and evaluating perplexity."""
