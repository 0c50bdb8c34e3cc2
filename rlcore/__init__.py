from rlcore import torchvision_shim as _torchvision_shim

# Before anything can import torchvision (vLLM's and transformers' Qwen-VL processors do): see
# rlcore/torchvision_shim.py for why a CPU install needs it.
_torchvision_shim.install()
