"""The K3 model: `K3Model` (the nn.Module), its parameter-name table and deterministic init."""

from k3core.model.k3model import K3Model
from k3core.model.parameters import parameter_shapes

__all__ = ["K3Model", "parameter_shapes"]
