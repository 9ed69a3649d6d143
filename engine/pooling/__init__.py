"""Pooling models: encoders (the BERT family) and their heads, served as embeddings,
scores and rerankings (`server/embeddings.py`) by an engine of their own (`AsyncPooler`)."""
