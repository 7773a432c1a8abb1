"""llama.cpp's own convert_hf_to_gguf.py, as `tests/llamacpp_converter.convert` runs it: argv = [this file, the
converter tree, the converter's arguments]. A script run by path: in a fresh interpreter, or by a warm server
(pipelines/process/warm.py) that has imported torch and transformers once, which is where a tiny model's conversion
spent nearly all of its seconds.

Nothing of the converter is preloaded: its own gguf-py must come first on the path, before any `gguf`.
"""

import os
import runpy
import sys


def preload() -> None:
    """The warm server's imports: torch and transformers (with the hub-kernel modules its models reach), which the
    converter imports first."""
    from importlib import import_module

    for name in ("torch", "transformers", "transformers.activations"):
        import_module(name)
    if "gguf" in sys.modules or "conversion" in sys.modules:
        raise RuntimeError("a `gguf` was imported before the converter's own gguf-py")
    for stream in (sys.stdout, sys.stderr):
        stream.flush()


def main(argv: list[str]) -> int:
    tree = argv[1]
    sys.path[:0] = [tree, tree + "/gguf-py"]
    import conversion.base as base

    known = base.TextModel.get_vocab_base_pre

    def named_or_smollm(self, tokenizer):
        try:
            return known(self, tokenizer)
        except NotImplementedError:  # the cut test vocabulary: SmolLM2's pre-tokenizer, as the tests name it
            return "smollm"

    base.TextModel.get_vocab_base_pre = named_or_smollm
    if os.environ.get("HIVE_AOT_TENSORS_ONLY"):  # the tensors are compared; the vocabulary is tested on its own
        import conversion

        conversion.load_all_models()
        todo = [base.TextModel]
        while todo:
            cls = todo.pop()
            cls.set_vocab = lambda self: None
            todo += cls.__subclasses__()
    sys.argv = [tree + "/convert_hf_to_gguf.py", *argv[2:]]
    runpy.run_path(sys.argv[0], run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
