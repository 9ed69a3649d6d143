"""`python -m pagedserve serve ...`, the same as the `pagedserve` command."""

from pagedserve.cli import main

raise SystemExit(main())
