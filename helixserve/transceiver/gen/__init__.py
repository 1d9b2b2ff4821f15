"""What a gen rank runs: the receiver (`receiver.KVReceiver`) keeping one `inbound.Inbound` per
request, whose shard moves through one transport at a time (`transport`: the granted pull
`granted_pull`, the asked pull `asked_pull`, both copying with `pull`, or the tagged stream
`tagged_stream`), retracting receives that will not complete (`retract`) and calling the control
plane (`control_client`). Imports the shared `transceiver` modules, never `transceiver.ctx`."""
