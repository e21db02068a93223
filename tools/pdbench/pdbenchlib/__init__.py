"""pdbench internals; the entry point is tools/pdbench/pdbench.py."""
