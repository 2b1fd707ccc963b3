"""The torch side of kvtui, imported lazily: the model and its paged KV cache, the kernels its
one-token step uses, the device policy, the shipped weights and the NVML probe. Never the UI.

Importing `kvtui.gpu` itself is free: each module imports torch (or pynvml) on its own, and
`kvtui.gpu.probe` imports neither until a probe is opened."""
