"""MoE routing, gated activations and the routed-expert sum."""
