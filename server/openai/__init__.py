"""OpenAI's API and the extensions vLLM's clients expect beside it: `/v1/chat/completions`,
`/v1/completions`, `/v1/models`, `/tokenize` and `/detokenize`, and the pooling endpoints
(`/v1/embeddings`, `/score`, `/rerank`, `/classify`)."""
