"""Batched byte copies between cache tensors (the KV transfer's device path)."""
