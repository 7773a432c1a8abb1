"""`python -m pipelines.cli`: the `hive-aot` command."""
import sys

from .main import main

sys.exit(main())
