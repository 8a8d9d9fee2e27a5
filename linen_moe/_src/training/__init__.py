"""Training the reference decoders: the train step, the sharded step, skipping
non-finite steps, synthetic data and the front-end protocol. The layer itself
does not depend on this package."""
