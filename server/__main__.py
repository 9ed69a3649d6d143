"""`python -m server serve ...`, the same as the `pagedserve` command."""

from server.cli import main

raise SystemExit(main())
