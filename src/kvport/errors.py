"""One exception tree for all of kvport.

Every error kvport raises on purpose is a :class:`KVPortError`. Foreign errors (OSError, socket
errors, redis-py, torch, msgpack) are mapped at the boundary where they occur, ``raise X(...) from exc``,
so callers catch kvport types only. Backpressure is *not* an error: admission returns a
``Rejected(reason, retry_after)`` value; only a timed-out wait raises :class:`BackpressureTimeout`.

::

    KVPortError
    ├── UserInputError                 bad input from a person or a config file (CLI exit code 2)
    │   ├── UnitError                  "20 GiB/s" style strings that do not parse
    │   ├── UnknownModelError          not a preset and not a config.json
    │   ├── UnknownDeviceError         not an accelerator preset (kvport.planner.devices) nor cpu
    │   ├── DeviceDTypeError           a dtype the accelerator has no peak FLOP/s for (fp8 on an A100)
    │   ├── ModelTooLargeError         a model whose weights do not fit the device's memory
    │   ├── SpecError                  invalid or inconsistent KVSpec fields / config.json
    │   ├── ConfigError                invalid setting (KVPORT_* env, flags, profile file)
    │   └── MissingExtraError          an optional part whose extra is not installed (also an ImportError)
    ├── KeyingError                    tokens that cannot be keyed (wrong dtype/shape, out of range)
    ├── CodecError
    │   ├── UnknownCodecError          codec id not in the registry
    │   ├── CodecParamsError           parameters that do not match the spec / the buffers
    │   └── CorruptPayloadError        truncated or corrupted encoded payload
    ├── TierError
    │   ├── BufferMismatchError        caller buffer of wrong size / dtype / layout
    │   ├── TierFullError              no space (pool exhausted, ENOSPC, quota)
    │   │   └── QuotaExceededError     a tenant's quota is full of blocks that may not leave
    │   ├── CorruptBlockError          stored bytes fail their checksum or are truncated
    │   ├── TierUnavailableError       the backing service is down (Redis, remote server)
    │   └── BlockNotFoundError         a get of a key the tier does not hold
    ├── OwnershipError
    │   ├── IllegalMoveError           a state transition the ledger does not allow
    │   ├── UnknownBlockError          the ledger has no record of that block
    │   ├── UnknownPeerError           a hand-off to an owner this ledger does not know
    │   └── LeaseError                 lease / pin not held, wrong holder
    │       └── LeaseExpiredError      the lease lapsed at its TTL (releasing it changes nothing)
    ├── TransferError                  the caller should fall back to recompute
    │   ├── ProtocolError              bad magic, unknown version, truncated or oversized frame
    │   │   └── HandoffParamsError     a hand-off's kv_transfer_params kvport cannot use (engines/vllm/params)
    │   │       ├── HandoffNotSentError     no hand-off asked, or none in the params (never sent)
    │   │       ├── HandoffVersionError     a hand-off of another version
    │   │       └── HandoffUnreadableError  a field missing, of the wrong type or past its cap
    │   ├── IncompatibleSpecError      receiver refused the sender's spec (names the field)
    │   ├── ReshardError               heads of a re-shard missing, duplicated or not this rank's
    │   ├── ChecksumError              payload chunk failed its checksum
    │   ├── PeerError                  connection reset, peer died, peer stopped reading
    │   ├── AuthError                  handshake failed / missing token
    │   ├── BackpressureTimeout        waited for credits longer than the timeout
    │   └── DeadlineExceeded           a load ran past its deadline: it is a miss
    ├── PlannerError
    │   ├── ProfileError               missing, stale or malformed calibration profile
    │   ├── PlanInputError             nonsense request or observation (negative length, zero bandwidth)
    │   └── SimInputError              a simulation that cannot run as given (trace line, zero link, no engines)
    ├── ServerError                    a remote kvport server answered with an error
    └── EngineError                    engine adapter could not load / store KV
"""

from __future__ import annotations


class KVPortError(Exception):
    """Root of every error kvport raises on purpose."""


# ---------------------------------------------------------------- user input
class UserInputError(KVPortError):
    """Bad input from a person or a file: the CLI prints the message (no traceback) and exits 2."""


class UnitError(UserInputError):
    pass


class UnknownModelError(UserInputError):
    pass


class UnknownDeviceError(UserInputError):
    pass


class DeviceDTypeError(UserInputError):
    pass


class ModelTooLargeError(UserInputError):
    pass


class SpecError(UserInputError):
    pass


class ConfigError(UserInputError):
    pass


class MissingExtraError(UserInputError, ImportError):
    """A part of kvport was used whose extra (``pip install 'kvport[NAME]'``) is not installed.

    Also an ImportError, so ``except ImportError`` around an optional import keeps working; raised by
    :func:`kvport.extras.require`, which names the extra and the packages it found missing.
    """

    def __init__(self, message: str, extra: str = "", missing: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.extra = extra
        self.missing = missing


# ---------------------------------------------------------------- keys
class KeyingError(KVPortError):
    pass


# ---------------------------------------------------------------- codecs
class CodecError(KVPortError):
    pass


class UnknownCodecError(CodecError):
    pass


class CodecParamsError(CodecError):
    pass


class CorruptPayloadError(CodecError):
    pass


# ---------------------------------------------------------------- tiers
class TierError(KVPortError):
    pass


class BufferMismatchError(TierError):
    pass


class TierFullError(TierError):
    """No room. A refusal that came with backpressure (a server's Rejected) keeps its ``reason`` and
    ``retry_after_s`` (None: retrying cannot help), so the caller can wait as told."""

    def __init__(self, message: str = "", *, reason: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after_s = retry_after_s


class CorruptBlockError(TierError):
    pass


class QuotaExceededError(TierFullError):
    pass


class TierUnavailableError(TierError):
    pass


class BlockNotFoundError(TierError):
    pass


# ---------------------------------------------------------------- ownership
class OwnershipError(KVPortError):
    pass


class IllegalMoveError(OwnershipError):
    pass


class UnknownBlockError(OwnershipError):
    pass


class UnknownPeerError(OwnershipError):
    pass


class LeaseError(OwnershipError):
    pass


class LeaseExpiredError(LeaseError):
    pass


# ---------------------------------------------------------------- transfer
class TransferError(KVPortError):
    """Any failure of a KV transfer; the caller should recompute the affected tokens."""


class ProtocolError(TransferError):
    pass


class HandoffParamsError(ProtocolError):
    pass


class HandoffNotSentError(HandoffParamsError):
    pass


class HandoffVersionError(HandoffParamsError):
    pass


class HandoffUnreadableError(HandoffParamsError):
    pass


class IncompatibleSpecError(TransferError):
    """The receiver refused the sender's KV: ``field`` names the first mismatching field."""

    def __init__(self, field: str, expected: object, got: object) -> None:
        super().__init__(f"incompatible KV: {field} expected {expected!r}, got {got!r}")
        self.field = field
        self.expected = expected
        self.got = got


class ReshardError(TransferError):
    """A re-shard between TP widths cannot link: a head arrived twice, never arrived, is not this
    rank's, or the pieces disagree on the request (:mod:`kvport.transfer.reshard`)."""


class ChecksumError(TransferError):
    pass


class PeerError(TransferError):
    pass


class AuthError(TransferError):
    pass


class BackpressureTimeout(TransferError):
    pass


class DeadlineExceeded(TransferError):
    """A load ran past its deadline (:mod:`kvport.deadline`); the caller recomputes."""


# ---------------------------------------------------------------- planner / server / engines
class PlannerError(KVPortError):
    pass


class ProfileError(PlannerError):
    pass


class SimInputError(PlannerError, UserInputError):
    """A deployment or trace ``kvport simulate`` cannot run: names the field (and the trace line)."""


class PlanInputError(PlannerError):
    pass


class ServerError(KVPortError):
    pass


class EngineError(KVPortError):
    pass
