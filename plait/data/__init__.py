"""Corpora: documents to token ids once (tokenize_corpus.py, tokenize_worker.py), read back
through memory maps (corpus.py), global batches by epochs that depend only on the seed and the
step (batches.py), weighted mixtures of sources (mixture.py). docs/data.md describes them."""
