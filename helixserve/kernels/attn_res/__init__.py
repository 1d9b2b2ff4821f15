"""Attention residuals (Kimi K3 block AttnRes selection)."""
