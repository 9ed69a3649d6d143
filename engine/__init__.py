"""pagedserve's engine: model loading, paged model runner, sampler and the engines."""
