"""Fixed texts used for validation (changing them changes every validation number: bump VERSION), and the
calibration text that quantizers which learn from activations read (GGUF importance matrices, vLLM GPTQ);
it never overlaps the validation texts."""

from __future__ import annotations

from importlib import resources

VERSION = 2

# Held-out prose and code for logit parity (never used to build anything).
PARITY_TEXTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based inks and a screw press adapted from wine making. Within fifty years, "
    "presses were operating in more than two hundred cities across Europe, and the cost of books fell "
    "sharply. Scholars could compare identical copies of a text for the first time, which changed how "
    "knowledge was checked, corrected and shared.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n    for _ in range(n):\n"
    "        a, b = b, a + b\n    return a\n\nprint([fibonacci(i) for i in range(10)])\n",
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts of plant cells, water is "
    "split, oxygen is released, and carbon dioxide is fixed into sugars through the Calvin cycle. The rate "
    "depends on light intensity, temperature and the concentration of carbon dioxide in the air.",
    "Question: A train leaves the station at 3:15 pm and travels 180 km at 72 km/h. When does it arrive?\n"
    "Answer: It needs 180 / 72 = 2.5 hours, so it arrives at 5:45 pm.",
    "The old lighthouse keeper climbed the spiral stairs every evening at dusk. He trimmed the wick, polished "
    "the great lens until it gleamed, and watched the fishing boats return one by one across the grey water. "
    "On stormy nights he stayed awake until dawn, counting the seconds between each sweep of the beam and "
    "listening to the waves break against the rocks below.",
    "User: Can you explain what a hash table is?\nAssistant: A hash table stores key-value pairs. It uses a hash "
    "function to turn each key into an index in an array, so looking up a value usually takes constant time. "
    "When two keys land on the same index, the table resolves the collision, for example by chaining entries "
    "in a list or by probing for the next free slot.",
    "To replace a bicycle tyre, first release the brake and remove the wheel from the frame. Push the valve "
    "into the tyre, then use two levers to lift one side of the tyre over the rim. Pull out the old inner "
    "tube, check the inside of the tyre for thorns or glass, fit the new tube, and inflate it to the pressure "
    "printed on the sidewall.",
]

# Varied text for tokenizer id parity: code, digits, emoji, CJK, whitespace runs, accents.
TOKENIZER_TEXTS = [
    "Hello world! How are you today?",
    "  leading spaces and\ttabs\n\nnew lines   trailing  ",
    "3.14159 2026-11-29 1,000,000 0x1F 12345678901234567890",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    "emoji: 🚀🦙😶‍🌫️ ✅ and accents: naïve café déjà vu Ångström",
    "中文测试：我想在苹果工作。日本語のテキスト。한국어 텍스트.",
    "Привет, мир! Ελληνικά κείμενα. مرحبا بالعالم",
    "I've been 'told he's there, 'RE you sure? We'Ve a'lL",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
]

GENERATION_PROMPT = "The capital of France is"
GENERATION_TOKENS = 12

# Greedy continuations compared token by token between vLLM and transformers (prepared vLLM weights).
GREEDY_PROMPTS = [
    "The capital of France is",
    "def add(a, b):\n    return",
    "Once upon a time, in a small village by the sea,",
]
GREEDY_TOKENS = 16

# Calibration: data/calibration.txt (prose, code, dialogue, numbers, several languages), cut into sequences of
# CALIBRATION_CHUNK_TOKENS tokens, as llama.cpp's imatrix cuts its text into n_ctx chunks.
CALIBRATION_CHUNK_TOKENS = 256


def calibration_text() -> str:
    return resources.files(__package__).joinpath("data/calibration.txt").read_text(encoding="utf-8")


def calibration_chunks(ids: list[int], chunk: int = CALIBRATION_CHUNK_TOKENS) -> list[list[int]]:
    """The calibration text's token ids as consecutive sequences of `chunk` tokens (the last one shorter)."""
    return [ids[i:i + chunk] for i in range(0, len(ids), chunk)]
