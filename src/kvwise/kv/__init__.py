"""KV tensors: per-head variable-length storage, quantizers with real bit-packing, byte accounting."""
