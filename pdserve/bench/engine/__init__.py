"""`pdserve bench-engine`: the engine's decode steps on one device against their floor (cli.py)."""
