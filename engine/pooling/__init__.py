"""Pooling models: encoders (the BERT family) and decoders as embedders, cross-encoders
and decoder rerankers, served as embeddings, scores and rerankings (`server/openai/embeddings.py`)
by an engine of their own (`AsyncPooler`)."""
