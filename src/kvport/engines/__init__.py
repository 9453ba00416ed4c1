"""Engine adapters: transformers prefix reuse, the vLLM KV connector."""
