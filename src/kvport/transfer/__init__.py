"""KV transfer: wire format, sender/receiver, transports (inproc, shm, tcp), credit-based backpressure.

Modules, bottom to top::

    wire         frame encode/decode, MsgType, Limits (pure, no I/O)        docs/wire-format.md
    transport    Transport protocol (send / recv_into / readable / close), TokenBucket, RateLimited
    framing      FrameIO (sync) and read_frame_async / write_frame_async: adapters that fill buffers
    tcp | shm | inproc | striped   transports; auth: HMAC handshake for non-loopback listeners
    meta         TransferMeta (TRANSFER_BEGIN map) and check_compatible
    credits      Backpressure, CreditWindow, CreditPool, Admitted / Rejected(RejectReason, retry_after, detail)
    destination  Destination protocol: BlockTable, LayerMajor, HostTier
    sender | receiver   the two ends of a transfer (layer-wise streaming, wait_for_layer)
"""

from kvport.protocol.frame import Flags, Limits, MsgType
from kvport.protocol.rejects import Rejected, RejectReason
from kvport.protocol.transport import Transport
from kvport.transfer.credits import Admitted, Backpressure
from kvport.transfer.destination import (
    BlockTableDestination,
    Destination,
    DestinationFactory,
    HostTierDestination,
    LayerMajorDestination,
    host_tier_factory,
)
from kvport.transfer.meta import TransferMeta, check_compatible
from kvport.transfer.ratelimit import RateLimited, TokenBucket
from kvport.transfer.receiver import Incoming, Receiver
from kvport.transfer.sender import Outgoing, Sender

__all__ = [
    "Admitted", "Backpressure", "BlockTableDestination", "Destination", "DestinationFactory", "Flags",
    "HostTierDestination", "Incoming", "LayerMajorDestination", "Limits", "MsgType", "Outgoing", "RateLimited",
    "Receiver", "RejectReason", "Rejected", "Sender", "TokenBucket", "TransferMeta", "Transport", "check_compatible",
    "host_tier_factory",
]
