"""The `pagedserve` command (`pagedserve.cli`): it starts one server or Ray Serve replicas,
so it sits above both the server and the scale-out layer."""
