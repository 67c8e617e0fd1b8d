"""The in-process engine on transformers: engine (continuous batching), decode batch, KV cache, token sampler."""
