"""What a ctx worker runs: the sender (`sender.KVSender`) holding prefilled requests (`hold`), sending
them (`outbound`), granting pulls (`grant_issue`) and answering the control plane (`control_server`,
checked by `shard_request`). Imports the shared `transceiver` modules, never `transceiver.gen`."""
