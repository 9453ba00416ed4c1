"""KV transfer: wire format, sender/receiver, transports (inproc, shm, tcp), credit-based backpressure."""
