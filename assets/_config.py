"""The registry these definitions are instantiated from (loaded once per code location process)."""

from pipelines.config import Config

CONFIG = Config.load()
