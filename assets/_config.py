"""The registry these definitions are instantiated from (loaded once per code location process).

A recipe file that fails validation does not take the code location down: it is left out, logged, and shown
in the UI as a `broken_recipe/<id>` asset whose description is the reason (pipelines.config.registry.Config.load_tolerant).
"""

import logging

from pipelines.config.registry import Config

CONFIG, BROKEN_RECIPES = Config.load_tolerant()
for _rid, _why in sorted(BROKEN_RECIPES.items()):
    logging.getLogger("hive_aot").warning(f"recipe {_rid} left out of the code location: {_why}")
