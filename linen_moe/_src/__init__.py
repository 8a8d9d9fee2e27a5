"""linen_moe's implementation: private, free to move between releases.

Import the public names from `linen_moe` and its public modules instead.
"""
