"""Deployment planning (torch-free): how much memory each rank of each role needs, whether a
mapping fits a GPU, how many sequences it holds at a context length, the smallest mappings that
fit. ``helixserve plan`` prints it; the engine sizes its cache pools and refuses a config that
cannot fit with the same arithmetic (:mod:`.memory`)."""
