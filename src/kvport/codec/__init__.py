"""KV codecs: raw, lossless, int8, kivi4, mixed. Encode/decode into caller-provided buffers."""
