"""The shared runtime every K3 service is a thin layer over."""

from services.runtime import errors
from services.runtime.app import ServiceApp
from services.runtime.config import ConfigError, ServiceConfig

__all__ = ["ConfigError", "ServiceApp", "ServiceConfig", "errors"]
