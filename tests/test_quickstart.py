"""README.md is a guide: its quickstart runs as written, and every page and anchor it or docs/ links to exists.

The quickstart's commands are read from README.md (between its quickstart markers) and run one by one through
bash, in a fresh directory holding `./my-model` (the session's tiny Llama, a model of "your own" in Hugging Face
format), with `hive-aot` on PATH being this checkout's CLI and no store, registry or recipes set in the
environment: what a reader who just installed the build extra has.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from factories import copy_model

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
START, END = "<!-- quickstart:", "<!-- end of the quickstart -->"


def quickstart_commands() -> list[str]:
    text = README.read_text(encoding="utf-8")
    block = text[text.index(START):text.index(END)]
    body = block[block.index("```bash\n") + len("```bash\n"):block.rindex("```")]
    return [line for line in body.splitlines() if line.strip()]


def _hive_aot_on_path(bin_dir: Path) -> Path:
    """`hive-aot` as an installed console script would be, running this checkout's code."""
    bin_dir.mkdir()
    script = bin_dir / "hive-aot"
    script.write_text(f"#!{sys.executable}\nimport sys\nsys.path.insert(0, {str(REPO)!r})\n"
                      "from pipelines.cli.main import main\nsys.exit(main())\n")
    script.chmod(0o755)
    return bin_dir


def test_the_readme_quickstart_builds_publishes_pulls_and_serves_a_model(tiny_llama, tmp_path):
    commands = quickstart_commands()
    assert len(commands) == 5 and all(c.startswith("hive-aot ") for c in commands), commands
    verbs = [c.split()[1] for c in commands]
    assert {"build", "pull", "serve"} <= set(verbs), verbs  # built and published, pulled, served

    work = tmp_path / "work"
    work.mkdir()
    copy_model(tiny_llama, work / "my-model")
    env = {k: v for k, v in os.environ.items()
           if k not in ("HIVE_AOT_STORE", "HIVE_AOT_REGISTRY", "HIVE_AOT_RECIPES", "PYTHONPATH")}
    env["PATH"] = f"{_hive_aot_on_path(tmp_path / 'bin')}:{env['PATH']}"
    outputs = {}
    for command in commands:
        proc = subprocess.run(["bash", "-c", command], cwd=work, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{command}\n{proc.stdout}\n{proc.stderr}"
        outputs[command.split()[1]] = proc.stdout

    # what each step said it did is there on disk
    assert "compatible" in outputs["check"] and "gguf-f16" in outputs["check"], outputs["check"]
    manifests = list((work / "artifacts" / "manifests" / "my-org--my-model" / "gguf-f16").glob("*.json"))
    assert len(manifests) == 1, manifests  # published to ./artifacts, the default store
    build_id = manifests[0].stem
    assert "my-org/my-model" in outputs["ls"] and build_id[:12] in outputs["ls"], outputs["ls"]
    marker = json.loads((work / "served" / "hive-aot.json").read_text())
    assert marker["build_id"] == build_id, marker
    ggufs = list((work / "served").glob("*.gguf"))
    assert len(ggufs) == 1 and ggufs[0].read_bytes()[:4] == b"GGUF", ggufs
    # serve names the server and the file it pulled, and runs nothing with --dry-run
    assert re.search(rf"llama-server -m {re.escape(str(ggufs[0]))}\b", outputs["serve"]), outputs["serve"]


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lowercased, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
    return {_anchor(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def test_the_readme_links_every_docs_page_and_every_link_resolves():
    pages = sorted(DOCS.glob("*.md"))
    readme = README.read_text(encoding="utf-8")
    assert {p.name for p in pages} - {"README.md"} <= set(re.findall(r"\(docs/([\w-]+\.md)[#)]", readme))
    index = (DOCS / "README.md").read_text(encoding="utf-8")
    assert {p.name for p in pages} - {"README.md"} <= set(re.findall(r"\]\(([\w-]+\.md)[#)]", index))
    broken = []
    for page in [README, *pages]:
        text = re.sub(r"```.*?```", "", page.read_text(encoding="utf-8"), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists() or (anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved)):
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert broken == []
    assert len(readme.splitlines()) <= 300  # a guide; the rest is in docs/
