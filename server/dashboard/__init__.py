"""The live dashboard: its page, its script and its JSON (an optional room: the app
installs it through `server.capabilities`)."""
