"""Cloud AI 100: ONNX export with retained-state KV (export.py). The compile stage and the QPC target are
not built yet (issue 9); nothing registers this package as a kind until then."""
