"""RMSNorm and the gated RMSNorm of the KDA output."""
