"""Training a small checkpoint on local text, so that speculative decoding has a target (and
drafters) whose acceptance means something: :mod:`.corpus` reads and tokenizes the text,
:mod:`.trainer` runs a seeded AdamW loop through the serving model's own forward and writes a
normal checkpoint (``helixserve make-checkpoint --preset NAME --train-on DIR``)."""
