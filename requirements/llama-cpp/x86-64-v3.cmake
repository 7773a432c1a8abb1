# CMAKE_ARGS for llama-cpp-python on x86-64-v3 (Haswell / Zen and newer): AVX, AVX2, FMA, F16C, BMI2.
# No GGML_NATIVE, no AVX-512, no AMX: those exist only on some hosts of this kind.
# -frecord-gcc-switches keeps the compiler flags in the libraries (.GCC.command.line), which is how
# tests/test_llama_cpp_portability.py proves the installed build is this one.
-DGGML_NATIVE=OFF
-DGGML_CPU_ALL_VARIANTS=OFF
-DGGML_BACKEND_DL=OFF
-DGGML_SSE42=ON
-DGGML_AVX=ON
-DGGML_AVX2=ON
-DGGML_FMA=ON
-DGGML_F16C=ON
-DGGML_BMI2=ON
-DGGML_AVX_VNNI=OFF
-DGGML_AVX512=OFF
-DGGML_AVX512_VBMI=OFF
-DGGML_AVX512_VNNI=OFF
-DGGML_AVX512_BF16=OFF
-DGGML_AMX_TILE=OFF
-DGGML_AMX_INT8=OFF
-DGGML_AMX_BF16=OFF
-DGGML_CCACHE=OFF
-DCMAKE_C_FLAGS=-frecord-gcc-switches
-DCMAKE_CXX_FLAGS=-frecord-gcc-switches
