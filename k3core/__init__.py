"""K3 core: the model of the Kimi K3 architecture and everything around it that runs offline.

Subpackages import on demand (torch-free ones stay cheap): `k3core.config` / `presets` (shapes),
`k3core.ops` (plain-torch math, the kernels' oracle), `k3core.layers` + `k3core.model` (K3Model),
`k3core.cache` (BatchCache protocol, contiguous and paged caches), `k3core.sampling`, `k3core.generate`,
`k3core.planner` (`k3 plan`), `k3core.weights` / `quant` / `tokenizer` / `chat`. See docs/model.md.
"""
