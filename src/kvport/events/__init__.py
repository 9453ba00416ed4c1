"""KV events: which blocks a tier or an engine now holds or dropped, published the way vLLM publishes
its own (msgpack batches over ZeroMQ, sequence numbers, a replay socket), so that a KV-aware router
(:mod:`kvport.route`, llm-d's, Dynamo's) knows where every prefix already is.

Modules::

    wire    the events and their batches in vLLM's format; a decoder that caps everything (pure)
    bus     EventPublisher (PUB + ROUTER replay, its own thread) and Subscription (SUB, gaps replayed)
    store   StoreEvents: a TieredStore's tier changes as events (which tier, medium, locality)
"""
