"""The catalogs against the published configs and datasheets, and reading a user's config.json."""

from __future__ import annotations

import json

import pytest

from kvtui.sim.catalog import (
    GIB,
    ConfigError,
    GPUSpec,
    ModelSpec,
    UnknownNameError,
    compute_dtype,
    dtype_bytes,
    get_gpu,
    get_model,
    gpu_names,
    match_gpu,
    model_names,
    normalize_dtype,
    serving_dtypes,
)
from kvtui.sim.hf_config import model_from_hf_config
from kvtui.sim.memory import kv_bytes, kv_bytes_per_token

# Published Hugging Face config.json figures: the URL of each is in the comment beside it.
# (layers, heads, kv_heads, head_dim, hidden, intermediate, vocab, max_context)
PUBLISHED_MODELS = {
    # https://huggingface.co/openai-community/gpt2/blob/main/config.json
    "gpt2": (12, 12, 12, 64, 768, 3072, 50257, 1024),
    # https://huggingface.co/meta-llama/Llama-2-7b-hf/blob/main/config.json
    "llama-2-7b": (32, 32, 32, 128, 4096, 11008, 32000, 4096),
    # https://huggingface.co/meta-llama/Llama-2-13b-hf/blob/main/config.json
    "llama-2-13b": (40, 40, 40, 128, 5120, 13824, 32000, 4096),
    # https://huggingface.co/meta-llama/Llama-2-70b-hf/blob/main/config.json
    "llama-2-70b": (80, 64, 8, 128, 8192, 28672, 32000, 4096),
    # https://huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json
    "llama-3.1-8b": (32, 32, 8, 128, 4096, 14336, 128256, 131072),
    # https://huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json
    "llama-3.1-70b": (80, 64, 8, 128, 8192, 28672, 128256, 131072),
    # https://huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json
    "llama-3.2-1b": (16, 32, 8, 64, 2048, 8192, 128256, 131072),
    # https://huggingface.co/meta-llama/Llama-3.2-3B/blob/main/config.json
    "llama-3.2-3b": (28, 24, 8, 128, 3072, 8192, 128256, 131072),
    # https://huggingface.co/mistralai/Mistral-7B-v0.1/blob/main/config.json
    "mistral-7b": (32, 32, 8, 128, 4096, 14336, 32000, 32768),
    # https://huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json
    "qwen2.5-7b": (28, 28, 4, 128, 3584, 18944, 152064, 131072),
    # https://huggingface.co/google/gemma-2-9b/blob/main/config.json
    "gemma-2-9b": (42, 16, 8, 256, 3584, 14336, 256000, 8192),
    # https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json (head_dim here is
    # qk_nope_head_dim 128 + qk_rope_head_dim 64)
    "deepseek-v3": (61, 128, 128, 192, 7168, 18432, 129280, 163840),
}

# Parameter counts: the model cards' rounded figures, and the exact count of the config's shapes.
PUBLISHED_PARAMS = {
    "gpt2": 124_439_808,  # https://huggingface.co/openai-community/gpt2 ("124M")
    "llama-2-7b": 6_738_415_616,  # https://huggingface.co/meta-llama/Llama-2-7b-hf
    "llama-2-13b": 13_015_864_320,
    "llama-2-70b": 68_976_648_192,
    "llama-3.1-8b": 8_030_261_248,  # https://huggingface.co/meta-llama/Llama-3.1-8B
    "llama-3.1-70b": 70_553_706_496,
    "llama-3.2-1b": 1_235_814_400,  # model card: 1.23B
    "llama-3.2-3b": 3_212_749_824,  # model card: 3.21B
    "mistral-7b": 7_241_732_096,  # https://mistral.ai/news/announcing-mistral-7b ("7.3B")
    "qwen2.5-7b": 7_615_616_512,  # https://huggingface.co/Qwen/Qwen2.5-7B ("7.61B")
    "gemma-2-9b": 9_241_705_984,
    "deepseek-v3": 671_000_000_000,  # https://huggingface.co/deepseek-ai/DeepSeek-V3 ("671B")
}

# Vendor datasheets: (memory GB, bandwidth bytes/s, dense BF16 FLOP/s).
PUBLISHED_GPUS = {
    "t4": (16, 320e9, 65e12),  # nvidia.com T4 datasheet (FP16: Turing has no BF16)
    "v100-16gb": (16, 900e9, 125e12),  # nvidia.com/en-us/data-center/v100, SXM2 (FP16: no BF16)
    "a10": (24, 600e9, 125e12),  # nvidia.com/en-us/data-center/products/a10-gpu (250 sparse)
    "l4": (24, 300e9, 121e12),  # nvidia.com/en-us/data-center/l4 (242 TFLOPS with sparsity)
    "rtx-4090": (24, 1008e9, 165.2e12),  # Ada architecture whitepaper, appendix
    "v100-32gb": (32, 900e9, 125e12),  # nvidia.com/en-us/data-center/v100, SXM2 (FP16: no BF16)
    "a100-40gb": (40, 1555e9, 312e12),  # A100 datasheet
    "l40s": (48, 864e9, 362.05e12),  # nvidia.com/en-us/data-center/l40s (733 with sparsity)
    "a100-80gb": (80, 2039e9, 312e12),  # A100 datasheet (SXM)
    "h100-pcie": (80, 2e12, 756e12),  # H100 whitepaper, PCIe column (1,513 with sparsity)
    "h100": (80, 3.35e12, 989.4e12),  # nvidia.com/en-us/data-center/h100 (SXM)
    "gh200": (96, 4e12, 990e12),  # nvidia.com Grace Hopper page: 96 GB HBM3 (1,979 sparse)
    "h200": (141, 4.8e12, 989.4e12),  # nvidia.com/en-us/data-center/h200
    "b200": (180, 8e12, 2.25e15),  # DGX B200 datasheet: 1,440 GB, 64 TB/s over 8 GPUs
    "mi300x": (192, 5.3e12, 1307.4e12),  # amd.com MI300X page
}


def test_catalog_holds_the_named_models_and_gpus():
    assert set(model_names()) == set(PUBLISHED_MODELS) | {"tiny-austen"}
    assert gpu_names() == list(PUBLISHED_GPUS)


@pytest.mark.parametrize("name", list(PUBLISHED_MODELS))
def test_model_matches_its_published_config(name):
    spec = get_model(name)
    shape = (
        spec.layers,
        spec.heads,
        spec.kv_heads,
        spec.head_dim,
        spec.hidden_size,
        spec.intermediate_size,
        spec.vocab_size,
        spec.max_context,
    )
    assert shape == PUBLISHED_MODELS[name]
    assert spec.params == PUBLISHED_PARAMS[name]
    assert spec.source.startswith("https://huggingface.co/")


def test_architecture_details():
    assert get_model("mistral-7b").sliding_window == 4096
    assert get_model("mistral-7b").sliding_layers == tuple(range(32))
    gemma = get_model("gemma-2-9b")
    assert gemma.sliding_window == 4096 and gemma.sliding_layers == tuple(range(0, 42, 2))
    assert get_model("qwen2.5-7b").sliding_window is None  # use_sliding_window: false
    ds = get_model("deepseek-v3")
    assert (ds.kv_lora_rank, ds.qk_rope_head_dim, ds.active_params) == (512, 64, 37_000_000_000)
    assert ds.default_dtype == "fp8"
    tiny = get_model("tiny-austen")
    assert (tiny.layers, tiny.heads, tiny.kv_heads, tiny.head_dim, tiny.params) == (
        6,
        8,
        2,
        32,
        3_476_736,
    )


@pytest.mark.parametrize("name", list(PUBLISHED_GPUS))
def test_gpu_matches_its_datasheet(name):
    gpu = get_gpu(name)
    memory_gb, bandwidth, flops = PUBLISHED_GPUS[name]
    assert gpu.memory_bytes == memory_gb * GIB
    assert gpu.bandwidth_bytes_per_s == bandwidth
    assert gpu.peak_bf16_flops == flops
    assert gpu.source.startswith("https://")


def test_gpus_are_in_order_of_memory():
    memory = [get_gpu(name).memory_bytes for name in gpu_names()]
    assert memory == sorted(memory)


def test_parts_without_bf16_say_their_figure_is_fp16():
    for name in ("t4", "v100-16gb", "v100-32gb"):
        assert "no BF16" in get_gpu(name).notes and "FP16 tensor" in get_gpu(name).notes


def test_specs_are_frozen():
    with pytest.raises(AttributeError):
        get_model("gpt2").layers = 1  # type: ignore[misc]
    with pytest.raises(AttributeError):
        get_gpu("h100").memory_bytes = 1  # type: ignore[misc]
    assert isinstance(get_model("gpt2"), ModelSpec) and isinstance(get_gpu("t4"), GPUSpec)


def test_lookup_is_case_insensitive_and_cached():
    assert get_model("Llama-3.1-8B") is get_model("llama-3.1-8b")
    assert get_gpu(" H100 ") is get_gpu("h100")


def test_unknown_names_suggest_close_ones():
    with pytest.raises(UnknownNameError, match=r"did you mean llama-3\.1-8b") as info:
        get_model("llama-3-8b")
    assert isinstance(info.value, ValueError)
    assert "\n" not in str(info.value)
    with pytest.raises(UnknownNameError, match="did you mean h100"):
        get_gpu("h10")
    with pytest.raises(UnknownNameError, match="known:"):
        get_gpu("zzzzzz")


def test_dtype_names():
    assert normalize_dtype("bfloat16") == "bf16"
    assert normalize_dtype("torch.float32") == "fp32"
    with pytest.raises(UnknownNameError, match="fp8"):
        normalize_dtype("fp7")


# --- which catalog GPU a probed device is ---------------------------------------------------------

MIB = 2**20

# NVML's marketing name and total memory as the driver reports them (nvidia-smi's "MiB" column).
PROBED_GPUS = [
    ("Tesla T4", 15360 * MIB, "t4"),
    ("Tesla V100-SXM2-16GB", 16160 * MIB, "v100-16gb"),
    ("NVIDIA A10", 23028 * MIB, "a10"),
    ("NVIDIA L4", 23034 * MIB, "l4"),
    ("NVIDIA GeForce RTX 4090", 24564 * MIB, "rtx-4090"),
    ("Tesla V100-SXM2-32GB", 32510 * MIB, "v100-32gb"),
    ("NVIDIA A100-SXM4-40GB", 40960 * MIB, "a100-40gb"),
    ("NVIDIA A100-SXM4-40GB", 40536 * MIB, "a100-40gb"),
    ("NVIDIA L40S", 46068 * MIB, "l40s"),  # 48 GB GDDR6 less ECC's sixteenth
    ("NVIDIA A100-SXM4-80GB", 81920 * MIB, "a100-80gb"),
    ("NVIDIA H100 PCIe", 81559 * MIB, "h100-pcie"),
    ("NVIDIA H100 80GB HBM3", 81559 * MIB, "h100"),  # the SXM part: its name says no SXM
    ("NVIDIA GH200 480GB", 97871 * MIB, "gh200"),  # 480 GB is the CPU's LPDDR5X
    ("NVIDIA H200", 143771 * MIB, "h200"),
    ("NVIDIA B200", 183359 * MIB, "b200"),
    ("AMD Instinct MI300X", 192 * GIB, "mi300x"),
]


@pytest.mark.parametrize(("name", "total", "expected"), PROBED_GPUS)
def test_a_probed_gpu_matches_its_catalog_entry(name, total, expected):
    assert match_gpu(name, total) is get_gpu(expected)


def test_every_catalog_gpu_is_matched_by_its_own_name():
    assert {expected for _, _, expected in PROBED_GPUS} == set(gpu_names())
    for gpu in map(get_gpu, gpu_names()):
        assert match_gpu(gpu.display_name, int(gpu.memory_bytes * 0.95)) is gpu, gpu.name


@pytest.mark.parametrize(
    ("name", "total"),
    [
        ("NVIDIA L40S", 23034 * MIB),  # an L4's memory: an L40S is never an L4
        ("NVIDIA L4", 46068 * MIB),
        ("NVIDIA L40", 46068 * MIB),  # the L40 is not the L40S, nor the L4
        ("NVIDIA A10G", 23028 * MIB),  # AWS's part, not the A10
        ("NVIDIA RTX A6000", 48676 * MIB),
        ("NVIDIA H100 NVL", 95830 * MIB),
        ("NVIDIA H200 NVL", 143771 * MIB),
        ("NVIDIA A100 80GB PCIe", 81920 * MIB),  # the catalog's A100s are SXM
        ("Tesla V100S-PCIE-32GB", 32510 * MIB),
        ("NVIDIA GH200 144G HBM3e", 146 * GIB),  # the HBM3e GH200 is not the 96 GB one
        ("NVIDIA H800", 81559 * MIB),
        ("NVIDIA H20", 97871 * MIB),
        ("NVIDIA GeForce RTX 4090 Laptop GPU", 16376 * MIB),
        ("NVIDIA A100-SXM4-40GB MIG 3g.20gb", 19968 * MIB),  # a slice, not a GPU
        ("NVIDIA H100 80GB HBM3 MIG 7g.80gb", 81559 * MIB),
        ("NVIDIA H100 80GB HBM3", 40 * GIB),  # the name and the memory disagree
        ("", 80 * GIB),
    ],
)
def test_unknown_or_inconsistent_devices_match_nothing(name, total):
    assert match_gpu(name, total) is None


def test_memory_picks_between_sizes_of_one_part():
    assert match_gpu("NVIDIA A100-SXM4-80GB", 40960 * MIB) is get_gpu("a100-40gb")
    assert match_gpu("Tesla V100-SXM2-16GB", 32510 * MIB) is get_gpu("v100-32gb")


def test_without_the_total_only_an_unambiguous_name_matches():
    assert match_gpu("NVIDIA L40S", None) is get_gpu("l40s")
    assert match_gpu("NVIDIA H100 80GB HBM3", None) is get_gpu("h100")
    assert match_gpu("NVIDIA H100 PCIe", None) is get_gpu("h100-pcie")
    assert match_gpu("NVIDIA A100-SXM4-80GB", None) is None  # 40 or 80 GB: memory decides
    assert match_gpu("Tesla V100-SXM2-32GB", None) is None


# --- a user's own config.json -------------------------------------------------------------------

# Trimmed copies of the published files (same URLs as above): only the keys kvtui reads.
HF_CONFIGS = {
    "llama-2-7b": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_act": "silu",
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "max_position_embeddings": 4096,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 32,
        "tie_word_embeddings": False,
        "torch_dtype": "float16",
        "vocab_size": 32000,
    },
    "gpt2": {
        "model_type": "gpt2",
        "n_ctx": 1024,
        "n_embd": 768,
        "n_head": 12,
        "n_inner": None,
        "n_layer": 12,
        "n_positions": 1024,
        "vocab_size": 50257,
    },
    "llama-3.2-1b": {
        "head_dim": 64,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "max_position_embeddings": 131072,
        "model_type": "llama",
        "num_attention_heads": 32,
        "num_hidden_layers": 16,
        "num_key_value_heads": 8,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "vocab_size": 128256,
    },
    "mistral-7b": {
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "max_position_embeddings": 32768,
        "model_type": "mistral",
        "num_attention_heads": 32,
        "num_hidden_layers": 32,
        "num_key_value_heads": 8,
        "sliding_window": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "vocab_size": 32000,
    },
    "qwen2.5-7b": {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "max_position_embeddings": 131072,
        "max_window_layers": 28,
        "model_type": "qwen2",
        "num_attention_heads": 28,
        "num_hidden_layers": 28,
        "num_key_value_heads": 4,
        "sliding_window": 131072,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_sliding_window": False,
        "vocab_size": 152064,
    },
    "gemma-2-9b": {
        "head_dim": 256,
        "hidden_size": 3584,
        "intermediate_size": 14336,
        "max_position_embeddings": 8192,
        "model_type": "gemma2",
        "num_attention_heads": 16,
        "num_hidden_layers": 42,
        "num_key_value_heads": 8,
        "sliding_window": 4096,
        "torch_dtype": "float32",
        "vocab_size": 256000,
    },
    "deepseek-v3": {
        "first_k_dense_replace": 3,
        "hidden_size": 7168,
        "intermediate_size": 18432,
        "kv_lora_rank": 512,
        "max_position_embeddings": 163840,
        "model_type": "deepseek_v3",
        "moe_intermediate_size": 2048,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_attention_heads": 128,
        "num_experts_per_tok": 8,
        "num_hidden_layers": 61,
        "num_key_value_heads": 128,
        "q_lora_rank": 1536,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3"},
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "v_head_dim": 128,
        "vocab_size": 129280,
    },
}


def _write(tmp_path, data, name="config.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data), encoding="utf-8")
    return path


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_hf_config_reads_like_the_catalog(tmp_path, name):
    spec = model_from_hf_config(_write(tmp_path, HF_CONFIGS[name]))
    known = get_model(name)
    for field in ("layers", "heads", "kv_heads", "head_dim", "hidden_size", "vocab_size"):
        assert getattr(spec, field) == getattr(known, field), field
    assert (spec.intermediate_size, spec.max_context) == (
        known.intermediate_size,
        known.max_context,
    )
    assert (spec.sliding_window, spec.sliding_layers) == (
        known.sliding_window,
        known.sliding_layers,
    )
    assert spec.default_dtype == known.default_dtype
    assert kv_bytes_per_token(spec) == kv_bytes_per_token(known)
    assert kv_bytes(spec, 50_000, 2, "fp8") == kv_bytes(known, 50_000, 2, "fp8")
    # Shapes give the parameter count: exactly for Llama/Mistral/GPT-2, closely for the rest
    # (Qwen's q/k/v biases, Gemma's extra norms, DeepSeek's rounded 671B).
    assert spec.params == pytest.approx(known.params, rel=2e-3)


@pytest.mark.parametrize("name", ["gpt2", "llama-2-7b", "llama-3.2-1b", "mistral-7b"])
def test_hf_params_are_exact_for_dense_llama_and_gpt2(tmp_path, name):
    assert model_from_hf_config(_write(tmp_path, HF_CONFIGS[name])).params == PUBLISHED_PARAMS[name]


def test_hf_deepseek_counts_active_parameters(tmp_path):
    spec = model_from_hf_config(_write(tmp_path, HF_CONFIGS["deepseek-v3"]))
    assert spec.active_params == pytest.approx(37e9, rel=0.02)  # model card: 37B activated


def test_hf_layer_types_list(tmp_path):
    config = {**HF_CONFIGS["llama-2-7b"], "num_hidden_layers": 4, "sliding_window": 128}
    config["layer_types"] = ["sliding_attention", "full_attention"] * 2
    spec = model_from_hf_config(_write(tmp_path, config))
    assert spec.sliding_layers == (0, 2)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ({"hidden_size": 64}, "missing num_hidden_layers or n_layer"),
        ({**HF_CONFIGS["llama-2-7b"], "num_hidden_layers": "32"}, "positive integer"),
        ({**HF_CONFIGS["llama-2-7b"], "num_attention_heads": 0}, "positive integer"),
        ({**HF_CONFIGS["llama-2-7b"], "num_key_value_heads": 5}, "do not group"),
        ({**HF_CONFIGS["llama-2-7b"], "hidden_size": 4097}, "not a multiple"),
    ],
)
def test_bad_configs_raise_one_line(tmp_path, content, message):
    with pytest.raises(ConfigError, match=message) as info:
        model_from_hf_config(_write(tmp_path, content))
    assert "\n" not in str(info.value)
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("field", "value"), [("torch_dtype", "float7"), ("torch_dtype", 16), ("dtype", "uint8")]
)
def test_unknown_dtype_is_a_config_error_naming_the_field(tmp_path, field, value):
    config = {**HF_CONFIGS["llama-2-7b"], field: value}
    if field != "torch_dtype":
        del config["torch_dtype"]
    path = _write(tmp_path, config)
    with pytest.raises(ConfigError) as info:
        model_from_hf_config(path)
    assert str(info.value) == (
        f"{path}: {field} {value!r} is not a dtype kvtui knows "
        "(known: fp32, fp16, bf16, fp8, int8, int4)"
    )


def test_dtype_field_and_its_defaults(tmp_path):
    llama = HF_CONFIGS["llama-2-7b"]
    assert model_from_hf_config(_write(tmp_path, llama)).default_dtype == "fp16"
    no_dtype = {k: v for k, v in llama.items() if k != "torch_dtype"}
    # Nothing says: the weights beside it do (transformers' dtype "auto"), else fp32.
    assert model_from_hf_config(_write(tmp_path, no_dtype)).default_dtype == "fp32"
    weights = tmp_path / "model.safetensors"
    header = json.dumps({"w": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 4]}}).encode()
    weights.write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
    assert model_from_hf_config(_write(tmp_path, no_dtype)).default_dtype == "bf16"
    weights.unlink()
    newer = {**no_dtype, "dtype": "float32"}  # newer transformers write `dtype`
    assert model_from_hf_config(_write(tmp_path, newer)).default_dtype == "fp32"
    assert model_from_hf_config(_write(tmp_path, HF_CONFIGS["gpt2"])).default_dtype == "fp32"
    # A quantization_config states the storage format, whatever torch_dtype says.
    gptq = {**llama, "torch_dtype": "int32", "quantization_config": {"quant_method": "gptq"}}
    assert model_from_hf_config(_write(tmp_path, gptq)).default_dtype == "int4"
    # 8-bit integers are int8, not fp8: a byte each, another format.
    eight = {**llama, "quantization_config": {"quant_method": "bitsandbytes", "load_in_8bit": True}}
    assert model_from_hf_config(_write(tmp_path, eight)).default_dtype == "int8"
    assert normalize_dtype("int8") == "int8" and dtype_bytes("int8") == dtype_bytes("fp8") == 1


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        model_from_hf_config(tmp_path / "nope.json")
    with pytest.raises(ConfigError, match="cannot read"):
        model_from_hf_config(tmp_path)  # a directory


def test_binary_config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ConfigError):
        model_from_hf_config(path)


@pytest.mark.parametrize(
    ("stored", "gpu", "bf16", "runs"),
    [
        ("fp16", False, True, ("fp32", "fp16 weights; a CPU computes fp32")),  # the shipped model
        ("fp32", False, True, ("fp32", "the weights' own")),
        ("fp16", True, True, ("fp16", "the weights' own")),  # the shipped model on CUDA
        ("bf16", True, True, ("bf16", "the weights' own")),
        ("bf16", True, False, ("fp16", "bf16 weights; this GPU has no bf16")),
        ("fp32", True, True, ("fp32", "the weights' own")),
        ("fp8", True, True, ("bf16", "fp8 weights; no fp8 kernels here")),
        ("int8", True, True, ("bf16", "int8 weights; no int8 kernels here")),
    ],
)
def test_a_model_computes_in_its_own_dtype_where_the_device_can(stored, gpu, bf16, runs):
    assert compute_dtype(stored, gpu=gpu, gpu_has_bf16=bf16) == runs


def test_sim_and_the_what_if_price_a_model_as_vllm_serves_it():
    """vLLM's dtype "auto": fp32 weights in bf16, others as published; the KV cache in the
    activations' dtype (bf16 beside 8-bit and 4-bit weights)."""
    assert serving_dtypes("fp32") == ("bf16", "bf16")  # gemma-2-9b's config says float32
    assert serving_dtypes("fp16") == ("fp16", "fp16")
    assert serving_dtypes("fp8") == ("fp8", "bf16")  # deepseek-v3
    assert serving_dtypes("int4") == ("int4", "bf16")
