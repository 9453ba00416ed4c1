"""The kvport server: the shared external KV tier (asyncio, wire format, tenants, leases)."""
