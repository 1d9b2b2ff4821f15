"""KDA (Kimi Delta Attention): gate, chunked prefill, recurrent decode step."""
