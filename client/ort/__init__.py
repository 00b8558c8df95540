"""A device on an inference engine: ZO training with ONNX Runtime and numpy, no torch.

ZO needs only forwards (MobiZO's point), so a device that cannot install PyTorch (a phone, a
Pi) runs the task's exported forward in ONNX Runtime:

- `export` (packaging time, needs torch + onnx): the task's model becomes an ORT bundle, a
  directory holding the frozen encoder graph, the trainable top graph whose inputs are the
  trainable tensors stacked per probe, the tokenizer and a manifest;
- `bundle`, `runtime`, `device`, `http` (run time, numpy + onnxruntime + tokenizers): the
  device itself (sync by replay or snapshot, ZO steps, evaluation) and its REST transport.
  None of them imports torch (tests/client/ort/test_no_torch.py checks it).
"""
