"""Checkpoints of a run: orbax manager, metadata, the checkpoint tree, serving exports."""
