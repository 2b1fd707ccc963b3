"""Exact decode-work counts and KV-cache memory, without a UI, torch or NVML.

Everything here is pure Python (plus numpy where arrays help); `import kvtui.sim` must stay cheap.
"""
