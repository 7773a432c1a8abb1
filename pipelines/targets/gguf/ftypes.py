"""llama.cpp's file types (general.file_type): data shared by the quantizer and the converter that quantizes
as it streams."""

# Names as in llama.cpp's LLAMA_FTYPE_MOSTLY_*; values are its enum.
FTYPES = {
    "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10, "Q3_K_S": 11, "Q3_K_M": 12, "Q3_K_L": 13,
    "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16, "Q5_K_M": 17, "Q6_K": 18, "IQ2_XXS": 19, "IQ2_XS": 20, "Q2_K_S": 21,
    "IQ3_XS": 22, "IQ3_XXS": 23, "IQ1_S": 24, "IQ4_NL": 25, "IQ3_S": 26, "IQ3_M": 27, "IQ2_S": 28, "IQ2_M": 29,
    "IQ4_XS": 30, "IQ1_M": 31, "TQ1_0": 36, "TQ2_0": 37,
}

# The element type of the bulk of a file type's weight matrices, in CNCF ModelPack's precision words (the kind's
# describe_weights): the lossless outtypes' float types; "int<N>" for the linear N-bit integer blocks (each with its
# own scale, Q4_K's also a min), named after the type most matrices get (Q4_K_M gives a few Q6_K). The IQ and TQ
# types store codebook or ternary indices, no integer type: absent, so nothing is said.
WEIGHT_PRECISION = {
    "F32": "float32", "F16": "float16", "BF16": "bfloat16", "Q8_0": "int8", "Q6_K": "int6",
    "Q5_0": "int5", "Q5_1": "int5", "Q5_K_S": "int5", "Q5_K_M": "int5",
    "Q4_0": "int4", "Q4_1": "int4", "Q4_K_S": "int4", "Q4_K_M": "int4",
    "Q3_K_S": "int3", "Q3_K_M": "int3", "Q3_K_L": "int3", "Q2_K": "int2", "Q2_K_S": "int2",
}
