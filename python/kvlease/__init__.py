"""kvlease: the KV-cache lease protocol of kvlease-core (Rust), for Python engines.

Everything here is a thin binding of the Rust core (``kvlease._core``); no protocol rule is
re-implemented in Python. Time is integer nanoseconds on the caller's monotonic clock
(``time.monotonic_ns()``); durations in config objects are seconds.

* :class:`LeaseTable` — P's leases: grant, renew, release, complete, tick (SPEC §4).
* :class:`IssuedLeaseTable` — the same when another process issues the ids D names leases by
  (vLLM's scheduler): names, leases on their way, completions the transport reports.
* :class:`Renewer` — D's batched heartbeats and read safety (SPEC §5).
* :class:`Pull` — D's pull of one request's KV: when to read, whether to use it (SPEC D6).
* :func:`encode` / :func:`decode` / :func:`encode_heartbeats` — the wire codec (SPEC §9).
* :class:`LeaseConfig`, :func:`parse_kv_transfer_config` — config parsing (SPEC §2).
* ``kvlease.vllm`` — ``KvleaseConnector``, a vLLM KV connector built on these (needs vLLM).
"""

from kvlease._core import (
    DEFAULT_MAX_NOTIF_BYTES,
    WIRE_VERSION,
    Action,
    ConfigInvalid,
    IdIssuer,
    IssuedLeaseTable,
    KvleaseError,
    KvTransferConfig,
    LeaseConfig,
    LeaseTable,
    Pull,
    Released,
    Renewer,
    WireDecodeError,
    decode,
    encode,
    encode_heartbeats,
    is_kvlease_message,
    parse_kv_transfer_config,
    prompt_digest,
)

__all__ = [
    "DEFAULT_MAX_NOTIF_BYTES",
    "WIRE_VERSION",
    "Action",
    "ConfigInvalid",
    "IdIssuer",
    "IssuedLeaseTable",
    "KvleaseError",
    "KvTransferConfig",
    "LeaseConfig",
    "LeaseTable",
    "Pull",
    "Released",
    "Renewer",
    "WireDecodeError",
    "decode",
    "encode",
    "encode_heartbeats",
    "is_kvlease_message",
    "parse_kv_transfer_config",
    "prompt_digest",
]
