"""The reference decoders: an application of the layer, not part of it."""
