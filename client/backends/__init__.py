"""The device's backends: what runs a task's model (`base.Backend`): PyTorch (`torch`) or ONNX
Runtime with numpy (`ort`, no torch). `select.open_backend` builds the one a device is
configured for; `client.device.Device` holds the protocol logic above any of them."""
