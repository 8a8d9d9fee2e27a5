"""The configs: the layer's `MoEConfig`, the decoder's `ModelConfig`, their shared checks, the YAML files."""
