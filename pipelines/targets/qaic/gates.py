"""The gates of the two AI 100 kinds: an export bundle's onnxruntime parity, a QPC's predicted device quality."""

from __future__ import annotations

from pydantic import Field

from ...config.thresholds import Thresholds, gate


class ExportThresholds(Thresholds):
    """onnxruntime against transformers fp32 on the same ids: decoders over prefill + decode steps with the
    retained state fed back (top-1, |delta logit|); encoders over padded batches (|delta| of the hidden
    states and embeddings, cosine of the embeddings; top-1 of a classifier's logits). A gate whose metric
    an architecture does not have (top-1 of an embedding model, cosine of a decoder) does not apply to it."""

    min_ort_top1_agreement: float | None = Field(
        1.0, ge=0.0, le=1.0, json_schema_extra=gate("ort_top1_agreement", "onnxruntime top-1 agreement"))
    max_ort_abs_delta: float = Field(0.01, ge=0.0, json_schema_extra=gate(
        "ort_max_abs_delta", "onnxruntime max |delta| (logits, hidden states, embeddings)", ".3g"))
    min_ort_cosine: float | None = Field(None, ge=-1.0, le=1.0,
                                         json_schema_extra=gate("ort_min_cosine", "onnxruntime embedding cosine", ".6f"))


class QaicThresholds(Thresholds):
    """The device's predicted quality (weights and KV cache emulated at the compile's precisions) against
    transformers fp32 on the parity texts."""

    min_predicted_top1: float | None = Field(None, ge=0.0, le=1.0,
                                             json_schema_extra=gate("predicted_top1", "predicted top-1 agreement"))
    min_predicted_cosine: float | None = Field(
        None, ge=-1.0, le=1.0, json_schema_extra=gate("predicted_cosine", "predicted embedding cosine", ".6f"))
    max_predicted_kl: float | None = Field(None, ge=0.0, json_schema_extra=gate("predicted_kl", "predicted mean KL", ".5f"))
    max_predicted_ppl_delta: float | None = Field(
        None, json_schema_extra=gate("predicted_ppl_delta", "predicted perplexity change", ".4f"))
