"""Quality harness: KV codecs judged on the reference model (perplexity, top-1 agreement, KL)."""
