"""Speculative decoding's building blocks: drafters' proposals, the verification math and the stop
rules inside an accepted run.

- :mod:`.ngram`: prompt-lookup proposals (numpy, torch-free);
- :mod:`.verify`: greedy acceptance and exact rejection sampling over the target's logits (torch);
- :mod:`.accept`: appending an accepted run to a request under the plain-decoding stop rules
  (torch-free).

This package imports nothing but :mod:`helixserve.engine`'s leaves (request, stop, sampler); the
engine core may import it. Nothing here imports torch at package import.
"""
