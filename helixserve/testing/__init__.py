"""Helpers shared by the tests and the benchmarks (``bench/``): reference models built with
transformers (:mod:`.hf_reference`) and real servers on loopback (:mod:`.servers`). Serving code
never imports this package."""
