"""helixserve: disaggregated prefill/decode serving for Kimi-K3-family models."""

__version__ = "0.1.0"
