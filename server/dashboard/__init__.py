"""The live dashboard: its page, its script and its JSON (an optional component: the app
installs it through `server.capabilities`)."""
