import os

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
