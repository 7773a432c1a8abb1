"""Vision-language models in the vLLM target: which ones it prepares, and their engine check with an image.

A VLM is prepared as a causal LM is (build.py), whole: the vision tower and projector stay bf16 in every tier
(fp8.KEEP_HIGH_PRECISION keeps them out of FP8), the language model takes the recipe's format, and the processor's
files travel with the tokenizer's (snapshot.CARRIED_FILES). FP8 is offered where the language model's family is one
of FP8_ARCHITECTURES (`language_architecture`).

The image check. vLLM serves a VLM from a prompt holding the model's image placeholder plus a picture (its
`multi_modal_data`), which the model's HF processor turns into token ids and pixel tensors. The runner (runner.py, in
the vLLM venv) draws the check's picture (seeded, synthetic: IMAGE_PROMPTS), writes the prompt with vLLM's own
placeholder for the model class, scores it teacher-forced (prompt log-probabilities) and hands back what the HF
processor made of the same prompt and picture: the ids and every tensor. transformers then runs the artifact (fp32;
FP8 as vLLM computes it, artifact_model.py) on exactly those tensors, and the two are compared on the positions from
the last image token on (top-1, max |delta logprob|), the ids vLLM ran being checked equal to the processor's. The
processor runs in the engine's venv: it needs PIL (and, for some families, torchvision), which the build
environment does not carry.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ...core.errors import EngineFailed

if TYPE_CHECKING:  # numpy loads where an image check runs, not when the target is read (the pull client has none)
    import numpy as np

# The vision-language architectures vLLM runs natively that this target prepares, and the causal LM class of their
# language model where the architecture fixes it (else the text config's model type names it: TEXT_MODEL_TYPES).
VLM_LANGUAGE = {
    "Qwen2_5_VLForConditionalGeneration": "Qwen2ForCausalLM",
    "Qwen3VLForConditionalGeneration": "Qwen3ForCausalLM",
    "Gemma3ForConditionalGeneration": "Gemma3ForCausalLM",
    "Mistral3ForConditionalGeneration": None,  # text_config: mistral (Mistral Small 3.x)
    "LlavaForConditionalGeneration": None,  # text_config: llama (llava-1.5), mistral, qwen2 ...
    "Idefics3ForConditionalGeneration": None,  # text_config: llama (Idefics3-8B, SmolVLM)
}
VLM_ARCHITECTURES = frozenset(VLM_LANGUAGE)
TEXT_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                    "qwen3": "Qwen3ForCausalLM", "gemma": "GemmaForCausalLM", "gemma2": "Gemma2ForCausalLM",
                    "granite": "GraniteForCausalLM", "phi3": "Phi3ForCausalLM"}
DEFAULT_TEXT_MODEL_TYPE = {"LlavaForConditionalGeneration": "llama", "Mistral3ForConditionalGeneration": "mistral",
                           "Idefics3ForConditionalGeneration": "llama"}
# Module names of the vision side (tower, projector, connector) in checkpoints and in transformers' classes.
VISION_SIDE = re.compile(r"(^|\.)(vision_tower|visual|vision_model|multi_modal_projector|connector)(\.|$)")

# The check's prompts: text after the image placeholder, and the picture (seeded gradients and noise, drawn by the
# runner). Small, so every family's processor gives few image tokens (Qwen: 12; LLaVA-1.5 resizes to 336 px: 576).
IMAGE_PROMPTS = (
    {"text": "Describe this picture in one sentence, then say which colour fills its top left corner and why.",
     "image": {"width": 112, "height": 84, "seed": 0}},
)
# Tokens of vLLM's max_model_len the image prompt may take beyond the text ones (the processor decides how many)
IMAGE_CHECK_TOKENS = 2048


def is_vlm(config: dict[str, Any]) -> bool:
    archs = config.get("architectures") or []
    return bool(archs) and archs[0] in VLM_ARCHITECTURES


def language_architecture(architecture: str, config: dict[str, Any]) -> str | None:
    """The causal LM class of a VLM's language model (None: a family this target does not name)."""
    fixed = VLM_LANGUAGE.get(architecture)
    if fixed is not None:
        return fixed
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return TEXT_MODEL_TYPES.get(text.get("model_type") or DEFAULT_TEXT_MODEL_TYPE.get(architecture, ""))


def image_token(config: dict[str, Any]) -> int | None:
    value = config.get("image_token_id", config.get("image_token_index"))
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def decode_array(entry: dict[str, Any]) -> np.ndarray:
    """An array the runner sent (runner.encode_array: dtype, shape, base64 of the bytes)."""
    import numpy as np

    return np.frombuffer(base64.b64decode(entry["data"]), dtype=np.dtype(entry["dtype"])).reshape(entry["shape"])


def image_logits_into(model_dir: str, files: list[str], inputs: list[str], out_dir: str, resident: bool,
                      layers: int | None = None) -> dict[str, Any]:
    """transformers' logits of the artifact (or its first `layers` layers) on each image prompt's processor tensors
    (`inputs`: .npz files), written as `i{n}.npy`. The vision side (every unit outside the language model) is held
    loaded through each forward: some families read its weights without calling the module owning them."""
    import numpy as np
    import torch

    from ...process.isolation import peak_memory
    from .artifact_model import open_artifact

    lm, _reader = open_artifact(Path(model_dir), [Path(f) for f in files], resident=resident, layers=layers)
    try:
        names = {id(m): n for n, m in lm.model.named_modules()}
        language = names.get(id(lm.model.get_decoder()), "")
        vision = [m for prefix, m, _r in lm.units
                  if not (language and prefix.startswith(language + ".")) and not prefix.startswith("lm_head")]
        for n, path in enumerate(inputs):
            with np.load(path) as data:
                kwargs = {k: torch.from_numpy(np.array(data[k])) for k in data.files if k != "attention_mask"}
            with lm.loaded(*vision), torch.inference_mode():
                logits = lm.model(**kwargs, use_cache=False).logits[0]
            np.save(Path(out_dir) / f"i{n}.npy", logits.float().numpy())
    finally:
        lm.close()
    return {"usage": peak_memory() if not resident else {}}


def transformers_side(model_dir: Path, files: list[Path], prompts: list[dict[str, Any]], work: Path, *,
                      resident: bool, layers: int | None, step: str) -> list[np.ndarray]:
    """The artifact's logits on the processor tensors of the runner's image prompts: in this process when the whole
    artifact is resident, else in a child (its memory goes back when it ends)."""
    import numpy as np

    from ...process.isolation import run_isolated

    work.mkdir(parents=True, exist_ok=True)
    inputs = []
    for n, prompt in enumerate(prompts):
        arrays = {k: decode_array(v) for k, v in prompt["inputs"].items()}
        np.savez(work / f"inputs{n}.npz", **arrays)
        inputs.append(str(work / f"inputs{n}.npz"))
    args = dict(model_dir=str(model_dir), files=[str(f) for f in files], inputs=inputs, out_dir=str(work),
                resident=resident, layers=layers)
    if resident and layers is None:
        image_logits_into(**args)
    else:
        run_isolated(image_logits_into, engine="transformers", needs_torch=True,
                     step=step, **args)
    return [np.load(work / f"i{n}.npy") for n in range(len(prompts))]


def compare_images(prompts: list[dict[str, Any]], logits: list[np.ndarray], config: dict[str, Any]
                   ) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """vLLM's teacher-forced rows of each image prompt against transformers' logits on the processor's tensors, from
    the last image token on (each of those predictions reads the image). EngineFailed where the two did not run the
    same thing: vLLM's ids are not the processor's, or no image token is in them."""
    from ...validation import parity

    token = image_token(config)
    agree = total = 0
    max_delta = 0.0
    per_prompt = []
    for prompt, lg in zip(prompts, logits):
        ids = [int(t) for t in prompt["ids"]]
        processed = decode_array(prompt["inputs"]["input_ids"]).reshape(-1).tolist()
        if processed != ids:
            raise EngineFailed(f"vLLM ran the image prompt as {len(ids)} tokens where the model's processor gives "
                               f"{len(processed)}: the engine and transformers would not compare the same input")
        image_rows = [p for p, t in enumerate(ids) if t == token]
        if not image_rows:
            raise EngineFailed(f"the image prompt's {len(ids)} tokens hold no image token ({token}): the processor "
                               "did not place the image")
        lp = parity.log_softmax(lg)
        n = m = 0
        delta = 0.0
        for p in range(image_rows[-1], len(ids) - 1):  # vLLM's row p scores the token at p + 1
            top_id, _top_lp, actual_lp = prompt["rows"][p]
            n += 1
            m += int(top_id == int(lp[p].argmax()))
            delta = max(delta, abs(actual_lp - float(lp[p, ids[p + 1]])))
        agree, total, max_delta = agree + m, total + n, max(max_delta, delta)
        per_prompt.append({"prompt": prompt["prompt"], "tokens": len(ids), "image_tokens": len(image_rows),
                           "positions": n, "top1_agreement": parity.round6(m / max(n, 1)),
                           "max_logprob_delta": parity.round6(delta), "processor": prompt.get("processor"),
                           "tensors": {k: v["shape"] for k, v in prompt["inputs"].items()}})
    metrics = {"vllm_image_positions": total, "vllm_image_top1_agreement": parity.round6(agree / max(total, 1)),
               "vllm_image_max_logprob_delta": parity.round6(max_delta)}
    return metrics, per_prompt


def check_images(result: dict[str, Any], engine_dir: Path, layers: int | None, resident: bool,
                 config: dict[str, Any], work: Path, step: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The engine's image prompts (runner result) against transformers on the directory the engine loaded (the
    artifact, or its layer slice): metrics and a record per prompt."""
    prompts = result.get("image_prompts") or []
    if len(prompts) != len(IMAGE_PROMPTS):
        raise EngineFailed(f"vLLM answered {len(prompts)} of {len(IMAGE_PROMPTS)} image prompts: an incomplete "
                           "result, nothing was published")
    logits = transformers_side(engine_dir, sorted(engine_dir.glob("*.safetensors")), prompts, work,
                               resident=resident, layers=layers, step=f"{step}: the image prompts in transformers")
    return compare_images(prompts, logits, config)
