"""Tiers: host RAM, local disk, Redis, remote server, device. Bytes in, bytes out; no owners, no policy."""
