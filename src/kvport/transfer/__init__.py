"""KV transfer: sender/receiver, transports (inproc, shm, tcp, striped), credit-based backpressure.

The wire (frames, typed messages, the handshake, the sync shell FrameIO) is :mod:`kvport.protocol`,
below this package. Modules, bottom to top::

    tcp | shm | inproc | striped   transports (tcp: listener / connect over protocol.net sockets,
                                   the one handshake beyond loopback; inproc: a thread pipe for tests)
    ratelimit    TokenBucket, RateLimited: a transport kept to a rate (a slow link, emulated)
    links        authenticated links named by an address (HOST:PORT, shm:NAME or nixl:HOST:PORT): LinkListener, dial;
                 every connection authenticated, the handshake bound to the address dialled
    meta         check_compatible (TransferMeta, the TRANSFER_BEGIN map, is protocol.transfer's)
    credits      Backpressure, CreditWindow, CreditPool, Admitted (Rejected is protocol.rejects')
    destination  Destination protocol: BlockTable, LayerMajor, HostTier
    linkcodec    a codec per link: block-layers travel encoded
    sender | receiver   the two ends of a transfer: layer-wise streaming or whole blocks, every
                 (block, layer) verified exactly once, commits recorded as hand-offs between ledgers
    reshard      re-shard between TP widths: a rank's heads assembled from senders of another width
                 (Assemblies, HeadAssembly: every head once, keys checked) or split for its receivers
    handoff      the hand-off between engines: HandoffListener (a Receiver per authenticated
                 connection, capped, transfer deadline) and HandoffDialer (pooled Senders to the
                 deployment's destinations only), both ledgers recording it; records() asks a
                 listener for its ledger's newest moves (``kvport inspect --handoff``)
    nixl         the NIXL transport (kvport[nixl]): contract, grant, per-piece checksums and commit
                 on kvport's control channel, the bytes by NIXL WRITE between registered buffers
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
