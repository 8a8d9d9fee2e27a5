"""xprof.cli.tools of the import-only stand-in (see xprof/__init__.py)."""
