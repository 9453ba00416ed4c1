"""TieredStore: lookup, put/get, promotion and eviction across tiers, prefetch, lifetimes."""
