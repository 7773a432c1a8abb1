"""hive-aot as users install it: the built wheel in fresh venvs, run from outside the checkout.

- `[build]`: `check` and a tiny `build` work from any directory with no registry: the registry
  profiles, architecture facts and recipes ship in the package.
- the base package alone (the serving containers' pull client): `pull` works, and `check` /
  `build` / `onboard` each say in one line which extra they need, as an s3:// store does without `[s3]`.
The venvs reuse the pinned wheels: the compiled llama-cpp-python from `make setup`'s cache
($HIVE_AOT_LLAMA_WHEELS), everything else through pip's cache and requirements/constraints.txt.
Each venv is fresh and gets the wheel by pip, but its dependencies (for `[build]`, torch and the rest:
two minutes of installing) come from a venv cached beside `make setup`'s, keyed by what the wheel
requires, the extra, the constraints and the interpreter, and seen through a .pth file: pip resolves the
requirement against them and must install nothing but hive-aot.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from pipelines.config.registry import Config
from pipelines.engine.build import build_and_publish

REPO = Path.cwd()
MODEL = "test-org/packaged"


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    """A working directory outside the checkout and an environment that knows nothing of it."""
    cwd = tmp_path_factory.mktemp("elsewhere")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "HIVE_AOT_REGISTRY", "HIVE_AOT_RECIPES", "HIVE_AOT_STORE")}
    env["HIVE_AOT_CACHE"] = str(tmp_path_factory.mktemp("installed-cache"))
    return cwd, env


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the tracked tree (the checkout stays untouched)."""
    src = tmp_path_factory.mktemp("src")
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, capture_output=True,
                           check=True).stdout.decode().split("\0")
    for rel in filter(None, files):
        p = REPO / rel
        if not p.exists() and not p.is_symlink():
            continue  # deleted in the work tree
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        if p.is_symlink():
            (src / rel).symlink_to(os.readlink(p))
        elif p.is_file():
            shutil.copy2(p, src / rel)
    dist = tmp_path_factory.mktemp("dist")
    proc = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(dist),
                 str(src)], cwd=src, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (whl,) = dist.glob("hive_aot-*.whl")
    return whl


def test_wheel_carries_every_data_file_the_package_reads(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    tracked = subprocess.run(["git", "ls-files", "pipelines"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()
    data = [f for f in tracked if not f.endswith(".py")]
    missing = [f for f in data if not any(n == f or n.startswith(f + "/") for n in names)]
    assert missing == []
    # the packaged defaults are real files with the top-level content
    assert "pipelines/config/defaults/registry.yaml" in names and "pipelines/compat/data/architectures.json" in names
    recipes = sorted(n.rsplit("/", 1)[1] for n in names if n.startswith("pipelines/config/defaults/recipes/"))
    assert recipes == sorted(p.name for p in (REPO / "recipes").glob("*.yaml"))
    with zipfile.ZipFile(wheel) as z:
        assert z.read("pipelines/config/defaults/registry.yaml") == (REPO / "registry.yaml").read_bytes()


CONSTRAINTS = REPO / "requirements" / "constraints.txt"
# Cached venvs live with `make setup`'s (Makefile: CACHE/venvs, keyed by a hash of what defines them).
CACHED_VENVS = Path.home() / ".cache" / "hive-aot" / "venvs"


def _site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def _venv(root: Path, name: str, requirement: str, env: dict[str, str], extra: list[str] = (),
          dependencies: Path | None = None) -> Path:
    """A fresh venv with `requirement` installed by pip. `dependencies`: a site-packages directory the venv sees
    after its own (a .pth file), which pip counts as installed when it resolves the requirement: it must
    find every dependency there and install hive-aot alone."""
    venv = root / name
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    if dependencies is not None:
        # site.addsitedir, not a bare path line: it also runs the .pth files of the packages installed there
        (_site_packages(venv) / "hive_aot_test_dependencies.pth").write_text(
            f"import site; site.addsitedir({str(dependencies)!r})\n")
    proc = _run([str(venv / "bin" / "pip"), "install", "-q", "-c", str(CONSTRAINTS), *extra, requirement],
                cwd=root, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if dependencies is not None:
        assert _installed(venv) - {"pip", "setuptools"} == {"hive_aot"}, proc.stdout
    return venv / "bin" / "hive-aot"


def _installed(venv: Path) -> set[str]:
    """The distributions installed in the venv itself (not those it sees through a .pth file)."""
    return {p.name.split("-", 1)[0].lower() for p in _site_packages(venv).glob("*.dist-info")}


def _dependencies(wheel: Path, extra: str | None, env: dict[str, str], pip_args: list[str] = ()) -> Path:
    """The site-packages of a venv holding what the wheel (with `extra`) requires and not hive-aot itself: built
    once per key (the wheel's Requires-Dist lines, the extra, the constraints, the wheels pip_args' --find-links
    offers, the interpreter) by installing the wheel and uninstalling hive-aot, then renamed into place in one
    step (a concurrent session building the same key keeps whichever lands first: they are the same)."""
    with zipfile.ZipFile(wheel) as z:
        (metadata,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        requires = [ln for ln in z.read(metadata).decode().splitlines() if ln.startswith("Requires-Dist:")]
    pip_args = list(pip_args)
    links = pip_args[pip_args.index("--find-links") + 1] if "--find-links" in pip_args else None
    offered = sorted(p.name for p in Path(links).iterdir()) if links else []
    key = hashlib.sha256(json.dumps([requires, extra, CONSTRAINTS.read_text(), pip_args, offered, sys.version,
                                     sys.base_prefix]).encode()).hexdigest()[:16]
    layer = CACHED_VENVS / f"test-{extra or 'base'}-dependencies-{key}"
    if not layer.is_dir():
        building = CACHED_VENVS / f"{layer.name}.{os.getpid()}.tmp"
        shutil.rmtree(building, ignore_errors=True)
        CACHED_VENVS.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "venv", str(building)], check=True, timeout=300)
        pip = str(building / "bin" / "pip")
        requirement = f"{wheel}[{extra}]" if extra else str(wheel)
        for args in (["install", "-q", "-c", str(CONSTRAINTS), *pip_args, requirement],
                     ["uninstall", "-q", "-y", "hive-aot"]):
            proc = _run([pip, *args], cwd=building, env=env, timeout=1800)
            assert proc.returncode == 0, proc.stderr[-3000:]
        try:
            building.rename(layer)
        except OSError:  # another session's landed first
            shutil.rmtree(building)
    return _site_packages(layer)


@pytest.fixture(scope="module")
def published_store(tiny_llama, tmp_path_factory) -> Path:
    from factories import write_test_config

    root = tmp_path_factory.mktemp("pkg-store")
    config = Config.load(write_test_config(root / "cfg", REPO))
    res = build_and_publish(str(tiny_llama), "gguf-f16", config, str(root / "store"), MODEL)
    assert res.state == "published"
    return root / "store"


# boto3 and botocore (about 30 MB) only with the [s3] extra: a pull from a directory or oci:// needs neither.
HEAVY = ("torch", "transformers", "numpy", "dagster", "boto3", "botocore")


@pytest.fixture(scope="module")
def base_client(wheel, outside, tmp_path_factory) -> tuple[Path, Path]:
    """The base install (no extra): its hive-aot, and the site-packages of the dependencies it sees."""
    _, env = outside
    dependencies = _dependencies(wheel, None, env)
    return _venv(tmp_path_factory.mktemp("base"), "client", str(wheel), env, dependencies=dependencies), dependencies


def test_base_install_pulls_and_names_the_missing_extra(base_client, outside, published_store, tiny_llama):
    cwd, env = outside
    hive, _ = base_client
    for heavy in HEAVY:  # the light client really has none of them
        site = subprocess.run([str(hive.parent / "python"), "-c", f"import {heavy}"], capture_output=True)
        assert site.returncode != 0, heavy
    pulled = _run([str(hive), "pull", MODEL, "--target", "llm-llamacpp-cpu", "--dest", str(cwd / "m"),
                   "--store", str(published_store), "--json"], cwd=cwd, env=env)
    assert pulled.returncode == 0, pulled.stderr
    assert Path(json.loads(pulled.stdout)["files"][0]).read_bytes()[:4] == b"GGUF"
    # and where they are installed (the full venv), pull imports none of them either
    probe = ("import sys; from pipelines.cli.main import main; rc = main(sys.argv[1:]); "
             f"print(sorted(m for m in {HEAVY!r} if m in sys.modules)); sys.exit(rc)")
    full = _run([sys.executable, "-c", probe, "pull", MODEL, "--target", "llm-llamacpp-cpu", "--dest",
                 str(cwd / "m2"), "--store", str(published_store)], cwd=cwd, env=env)
    assert full.returncode == 0, full.stderr
    assert full.stdout.strip().splitlines()[-1] == "[]", full.stdout
    # every command the README lists for the base install runs there (red team round two, item 14: `registry
    # backends` needed the build extra)
    store = str(published_store)
    for args in (["registry", "backends", "--json"], ["profiles", MODEL, "--store", store, "--json"],
                 ["ls", "--store", store, "--json"], ["gc", "--store", store, "--dry-run", "--json"],
                 ["retire", MODEL, "--store", store, "--dry-run", "--json"],
                 ["serve", MODEL, "--target", "llm-llamacpp-cpu", "--dest", str(cwd / "s"), "--store", store,
                  "--dry-run", "--json"]):
        proc = _run([str(hive), *args], cwd=cwd, env=env)
        assert proc.returncode == 0 and json.loads(proc.stdout), (args, proc.stderr)
    for args, extra in ((["check", str(tiny_llama), "--model-id", MODEL], "build"),
                        (["build", str(tiny_llama), "--recipe", "gguf-f16", "--model-id", MODEL], "build"),
                        (["onboard"], "orchestrate")):
        proc = _run([str(hive), *args], cwd=cwd, env=env)
        assert proc.returncode == 1, (args, proc.stderr)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, proc.stderr
        assert lines[0].startswith(f"hive-aot: error: `hive-aot {args[0]}` needs the '{extra}' extra (module ")
        assert lines[0].endswith(f"is not installed): pip install 'hive-aot[{extra}]'")


def _tree_bytes(path: Path) -> int:
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def test_base_install_names_the_s3_extra_and_stays_small(base_client, outside, tmp_path):
    """An s3:// store without boto3 is one line naming the extra, for pull and for the store commands; the base
    install (hive-aot and what it requires, over a bare venv's pip) stays small: the README says its size."""
    cwd, env = outside
    hive, dependencies = base_client
    for args in (["pull", MODEL, "--target", "llm-llamacpp-cpu", "--dest", str(cwd / "s3m")],
                 ["ls"], ["profiles", MODEL]):
        proc = _run([str(hive), *args, "--store", "s3://models/hive-aot"], cwd=cwd, env=env)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 1 and len(lines) == 1, (args, proc.stderr)
        assert lines[0] == ("hive-aot: error: s3://models/hive-aot needs boto3, which the base install leaves out (boto3 is "
                            "missing): pip install 'hive-aot[s3]'"), lines[0]
    assert not (cwd / "s3m").exists()
    subprocess.run([sys.executable, "-m", "venv", str(tmp_path / "bare")], check=True, timeout=300)
    bare = _tree_bytes(_site_packages(tmp_path / "bare"))
    installed = _tree_bytes(_site_packages(hive.parent.parent)) + _tree_bytes(dependencies) - 2 * bare
    print(f"base install: {installed / 1e6:.1f} MB over a bare venv")
    assert 5e6 < installed < 25e6, installed  # boto3 alone would add about 30 MB


def test_build_extra_checks_and_builds_outside_the_checkout(wheel, outside, tiny_llama, tmp_path):
    cwd, env = outside
    wheels = os.environ.get("HIVE_AOT_LLAMA_WHEELS")
    if not wheels or not Path(wheels).is_dir():
        pytest.fail("HIVE_AOT_LLAMA_WHEELS (the compiled llama-cpp-python) is not set: run through `make test`")
    pip_args = ["--find-links", wheels, "--only-binary", "llama-cpp-python"]
    hive = _venv(tmp_path, "factory", f"{wheel}[build]", env, pip_args,
                 dependencies=_dependencies(wheel, "build", env, pip_args))
    check = _run([str(hive), "check", str(tiny_llama), "--model-id", MODEL, "--hardware", "cpu", "--json"],
                 cwd=cwd, env=env)
    assert check.returncode == 0, check.stderr
    doc = json.loads(check.stdout)
    assert doc["status"] == "compatible" and doc["runtime_profile_id"] == "llm-llamacpp-cpu"
    assert {"gguf-f16", "gguf-q8_0", "gguf-q4_k_m"} <= set(doc["recipes"])
    store = tmp_path / "store"
    build = _run([str(hive), "build", str(tiny_llama), "--recipe", "gguf-f16", "--model-id", MODEL,
                  "--store", str(store), "--json"], cwd=cwd, env=env)
    assert build.returncode == 0, build.stderr
    res = json.loads(build.stdout)
    assert res["state"] == "published" and res["validation"]["passed"] is True
    assert (store / res["manifest"].split(store.as_uri() + "/", 1)[1]).is_file()
