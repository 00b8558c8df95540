"""The ONNX Runtime backend: ZO training with ONNX Runtime and numpy, no torch.

ZO needs only forwards (MobiZO's point), so a device that cannot install PyTorch (a phone, a
Pi) runs the task's exported forward in ONNX Runtime:

- `export` (packaging time, needs torch + onnx): the task's model becomes an ORT bundle, a
  directory holding the frozen encoder graph, the trainable top graph whose inputs are the
  trainable tensors stacked per probe, the tokenizer and a manifest;
- `bundle`, `runtime`, `backend` (run time, numpy + onnxruntime + tokenizers): the bundle,
  its forward and `OrtBackend`, which `client.device.Device` and its adapters run like the
  torch backend. None of them imports torch (tests/client/backends/ort/test_no_torch.py).
"""
