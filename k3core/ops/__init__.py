"""Plain-torch functional math of the K3 model: the CPU path and the oracle every kernel is tested against."""
