"""Causal depthwise short convolution (KDA q/k/v convs)."""
