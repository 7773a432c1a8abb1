# CMAKE_ARGS for llama-cpp-python on non-x86 hosts: the architecture's baseline, never -march=native.
-DGGML_NATIVE=OFF
-DGGML_CCACHE=OFF
-DCMAKE_C_FLAGS=-frecord-gcc-switches
-DCMAKE_CXX_FLAGS=-frecord-gcc-switches
