"""Scale-out: N pagedserve engine replicas behind one OpenAI-compatible ingress, on Ray Serve.

The layer sits above the server: every replica runs the server's own FastAPI app
(`server.app.build_app`) unchanged, and the ingress forwards whole HTTP requests to it, so
the API, streaming, errors and metrics are the server's. Ray Serve places, restarts and
health-checks the replicas; a Ray Serve request router (`router.PrefixAwareRouter`) picks
the replica for each request by the KV-cache block hashes of its prompt.

Dependencies: scale_out -> server -> engine -> scheduler -> cache, plus the cache's block
hash (`cache.block`) so that the router and the replicas agree on what a prefix is.
"""
