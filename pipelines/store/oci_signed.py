"""What an OCI store keeps beside a build's artifacts in its model repository: the OMS signature (a referrer of
each artifact showing the build) and the reads that work with nothing but that repository (a mirror).

The store key `signatures/<slug>/<recipe>/<build>.json.sig` holds an OMS bundle (signing.py). In a registry it
is not a tag of its own: it is attached (oci_referrers.py) to the build's manifest artifact `_m.<recipe>.<build>`
and to every ref artifact naming that build, so whichever tag a tool or a mirror copies, the signature is
found from that artifact's own digest. Reading the key returns the bundle attached to the build's manifest
artifact, else to a ref artifact naming it (a mirror that copied only refs). Stores signed before OMS hold an
Ed25519 document under the tag `_s.<recipe>.<build>`: still read (signing.py verifies it), never written again.

A model repository mirrored on its own (skopeo copy/sync) has no pool: every read a pull makes goes to the model's
repository, which holds every blob its artifacts name (mounted there at publish), and a build whose `_m.` tag was
not copied is read from the ref artifact that carries it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator

from ..core.errors import IntegrityError, StoreError
from .oci_client import MANIFEST_TYPE
from .oci_layout import Place, key_of
from .oci_modelpack import A_MANIFEST, annotation, read_document, ref_field
from .oci_referrers import attach_bundle, detach_all, find_bundle
from .oms import is_bundle


def descriptor(raw: bytes) -> dict:
    return {"mediaType": MANIFEST_TYPE, "digest": "sha256:" + hashlib.sha256(raw).hexdigest(), "size": len(raw)}


def manifest_tag(p: Place) -> str:
    """The build manifest's tag of a signature's place (`_s.<recipe>.<build>` -> `_m.<recipe>.<build>`)."""
    return "_m." + p.tag[3:]


class SignedArtifacts:
    """Mixed into OciStore (it provides registry, _repo, _document, uri)."""

    def _refs_naming(self, repo_name: str, manifest_key: str) -> Iterator[bytes]:
        """The ref artifacts (their manifest bytes) in model repository `repo_name` whose ref names `manifest_key`."""
        recipe = manifest_key.split("/")[2]
        repo = self._repo(repo_name)
        for tag in self.registry.tags(repo):
            key = key_of(repo_name, tag, repo_name)
            if not (key and key.startswith("refs/") and tag.startswith(recipe + ".")):
                continue
            got = self.registry.get_manifest(repo, tag)
            try:
                doc = read_document(got[0], f"{repo}:{tag}") if got else None
                named = ref_field(doc.data, "manifest") if doc else None
            except IntegrityError:
                continue  # another tool's artifact under a ref-like tag: not a ref of this build
            if named == manifest_key:
                yield got[0]

    def carried_manifest(self, p: Place, key: str) -> bytes | None:
        """A build's manifest document as a ref artifact naming it carries it: what a mirror that copied only the
        refs still has. The ref artifact itself is checked on read (check_view: the carried manifest is the one
        the ref's document names, by sha256)."""
        for raw in self._refs_naming(p.repo, key):
            carried = annotation(json.loads(raw).get("annotations") or {}, A_MANIFEST)
            want = ref_field(read_document(raw, self._repo(p.repo)).data, "manifest_sha256")
            if carried is not None and hashlib.sha256(carried).hexdigest() == want:
                return carried
        return None

    def _signed_subjects(self, p: Place, key: str) -> list[str]:
        """The digests of the artifacts showing the build a signature place is of: its manifest's, then refs'."""
        repo = self._repo(p.repo)
        digest = self.registry.head_manifest(repo, manifest_tag(p))
        manifest_key = "manifests/" + key[len("signatures/"):-len(".sig")]
        return ([digest] if digest else []) + [descriptor(raw)["digest"] for raw in self._refs_naming(p.repo, manifest_key)]

    def read_signature(self, p: Place, key: str) -> bytes | None:
        """The bundle attached to the build's manifest artifact, which is authoritative where it exists (a ref is
        signed from it); only where its tag is absent (a mirror that copied refs alone) the refs naming the build."""
        repo = self._repo(p.repo)
        digest = self.registry.head_manifest(repo, manifest_tag(p))
        subjects = [digest] if digest else [descriptor(raw)["digest"] for raw in
                                            self._refs_naming(p.repo, "manifests/" + key[len("signatures/"):-len(".sig")])]
        for subject in subjects:
            bundle = find_bundle(self.registry, repo, subject)
            if bundle is not None:
                return bundle
        doc = self._document(p, key)  # the Ed25519 format of stores signed before OMS
        return None if doc is None else doc.data

    def write_signature(self, p: Place, key: str, bundle: bytes) -> bool:
        """Attach an OMS bundle to the build's manifest artifact and the ref artifacts naming it; False when
        `bundle` is not one (a legacy document: the caller stores it under its own tag)."""
        if not is_bundle(bundle):
            return False
        repo = self._repo(p.repo)
        got = self.registry.get_manifest(repo, manifest_tag(p))
        if got is None:
            raise StoreError(f"{self.uri}: cannot store signature {key}: the manifest it signs is not in the store")
        manifest_key = "manifests/" + key[len("signatures/"):-len(".sig")]
        for raw in [got[0], *self._refs_naming(p.repo, manifest_key)]:
            attach_bundle(self.registry, repo, descriptor(raw), bundle)
        return True

    def sign_ref(self, p: Place, body: bytes, manifest_key: str | None) -> None:
        """Before a ref's tag is moved to artifact `body`: attach the bundle that signs the build it names."""
        if not manifest_key:
            return
        repo = self._repo(p.repo)
        digest = self.registry.head_manifest(repo, "_m." + manifest_key.split("/")[2] + "."
                                             + manifest_key.rsplit("/", 1)[1][:-len(".json")])
        bundle = find_bundle(self.registry, repo, digest) if digest else None
        if bundle is not None:
            attach_bundle(self.registry, repo, descriptor(body), bundle)

    def delete_signature(self, p: Place, key: str) -> None:
        repo = self._repo(p.repo)
        for digest in self._signed_subjects(p, key):
            detach_all(self.registry, repo, digest)

    def detach(self, repo: str, digest: str) -> None:
        """Before an artifact is deleted: the signatures attached to it go first (no referrer outlives its subject)."""
        detach_all(self.registry, repo, digest)
