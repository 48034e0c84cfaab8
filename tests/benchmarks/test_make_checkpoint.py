"""`fairlane bench make-checkpoint` makes a checkpoint fairlane serves with the default model's tokenizer."""

from __future__ import annotations

from pathlib import Path

from benchmarks.make_checkpoint import SHAPE, make_checkpoint
from gpu.models import convert_smollm2, load_model


def test_a_made_checkpoint_loads_with_the_default_models_tokenizer(tmp_path: Path, model_cache_dir: Path) -> None:
    small = {**SHAPE, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 256}
    out = make_checkpoint(tmp_path / "llama", seed=0, tokenizer_dir=convert_smollm2(model_cache_dir), shape=small)
    loaded = load_model(str(out), device="cpu", dtype="float32", quantization="int4")
    config = loaded.model.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_key_value_heads) == (128, 2, 2)
    assert config.vocab_size == 49152 and loaded.quantization == "int4"
    ids = loaded.tokenizer.encode_chat([{"role": "user", "content": "Hello"}])
    assert ids and loaded.tokenizer.decode(ids).count("Hello") == 1
