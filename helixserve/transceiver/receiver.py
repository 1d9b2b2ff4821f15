"""`KVReceiver` where `group.CPGroupReceiver` imports it from; the receiver is `gen.receiver`.

Only `group` imports this module: it goes with `CPGroupReceiver` (the engine's `RankTransfers`
drive the same receiver and consensus)."""

from helixserve.transceiver.gen.receiver import KVReceiver

__all__ = ["KVReceiver"]
