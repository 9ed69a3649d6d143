"""Tool calling: the models' call formats and a chat request's tools (an optional component: the
core reaches it only through `server.capabilities`)."""
