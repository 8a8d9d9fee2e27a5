"""LoRA adapters on the named contractions (see `adapters.py`)."""
