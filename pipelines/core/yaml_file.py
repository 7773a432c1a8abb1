"""Reading the project's YAML files (registry, recipes) as untrusted input: bounded, regular files only,
UTF-8, the safe loader; every failure one ConfigError line naming the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError
from .paths import read_small_file

MAX_YAML_BYTES = 16 << 20  # a registry of thousands of models is well under this


def load_yaml(path: Path) -> Any:
    try:  # bounded, regular files only: a recipe linked to /dev/zero or a FIFO in recipes/ must not hang
        text = read_small_file(path, MAX_YAML_BYTES).decode("utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: file not found") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: is not UTF-8 text (byte {e.start})") from None
    except ValueError as e:
        raise ConfigError(f"{path}: {e}") from None
    try:
        # libyaml's safe loader when PyYAML has it: a tenth of the time, in every CLI process's registry and recipes
        return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{path}:{where} is not valid YAML ({getattr(e, 'problem', e)})") from None
