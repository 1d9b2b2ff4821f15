"""What a gen rank runs: the receiver (`receiver.KVReceiver`) moving each shard in (`inbound`: a
granted or asked pull, `pull`, or the tagged stream), retracting receives that will not complete
(`retract`) and calling the control plane (`control_client`). Imports the shared `transceiver`
modules, never `transceiver.ctx`."""
