"""Training a small checkpoint (and a draft model against it) on local text, so that speculative
decoding has a target and drafters whose acceptance means something: :mod:`.corpus` reads and
tokenizes the text with a held-out split, :mod:`.trainer` runs a seeded AdamW loop through the
serving model's own forward and scores held-out text, :mod:`.checkpoint` trains the target and its
draft and writes them as normal checkpoints (``helixserve make-checkpoint --preset NAME --train-on
DIR``); :mod:`.config` holds the settings."""
