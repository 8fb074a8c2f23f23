"""Communication: every collective plait issues, accounted (see `collectives`)."""

from plait.comm.collectives import (
    LEDGER,
    CommLedger,
    Op,
    Pending,
    all_gather,
    all_reduce,
    all_reduced,
    all_to_all,
    barrier,
    broadcast,
    bus_bytes,
    recv,
    reduce_scatter,
    send,
    shift,
)

__all__ = [
    "LEDGER",
    "CommLedger",
    "Op",
    "Pending",
    "all_gather",
    "all_reduce",
    "all_reduced",
    "all_to_all",
    "barrier",
    "broadcast",
    "bus_bytes",
    "recv",
    "reduce_scatter",
    "send",
    "shift",
]
