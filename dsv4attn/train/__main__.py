"""``python -m dsv4attn.train`` (see dsv4attn/train/cli.py for the options)."""
from .cli import main

raise SystemExit(main())
