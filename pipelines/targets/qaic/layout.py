"""The names and versions of what the AI 100 kinds publish: the export's files, the bundle's format. A leaf:
the targets, the bundle writer and the compile of a published bundle all read them."""

# 2: weights streamed into page-aligned external data, matrices fp16 behind a Cast by default (weight_dtype)
# 3: a vision-language model's processor files travel with its tokenizer (snapshot.CARRIED_FILES)
EXPORT_FORMAT_VERSION = 3
BUNDLE_FORMAT_VERSION = 1
ONNX_DIR = "onnx"
EXPORT_REPORT = "export.json"
BUNDLE_FORMAT = "qaic-export-bundle"  # what a qaic build publishes until a host with the SDK compiles it
# the target LM of speculative decoding: an input whose length is the number of positions `logits` returns (and
# the dynamic axis and specialization symbol of that length), as QEfficient's TLM export names it
KEEP_INPUT = "num_logits_to_keep"
RETAINED = "_RetainedState"  # the suffix of a retained-state output (the device keeps it for the next call)
# a VLM's image state beside `vision_embeds` in both graphs (QEfficient's Qwen3-VL): the vision tower's DeepStack
# features [levels, images, vision_size, hidden], added to the first decoder layers' image rows
DEEPSTACK = "deepstack_features"
