"""Loading a model (``models.py``): one-line errors, a damaged cache named, and a fingerprint that does
not depend on the dtype."""
import pytest
import torch

from knnssd import conversion, models
from tiny import tiny


def test_model_errors_are_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("KNNSSD_CACHE", str(tmp_path / "cache"))
    for name, pattern in [
        ("no-such-model", "unknown model 'no-such-model'"),
        (str(tmp_path / "missing.gguf"), "GGUF file not found"),
        (str(tmp_path), "without config.json"),
    ]:
        with pytest.raises(models.ModelError, match=pattern) as e:
            models.load(name)
        assert "\n" not in str(e.value)
    with pytest.raises(models.ModelError, match="unknown dtype"):
        models.resolve_dtype("float8", torch.device("cpu"))
    for spec in ("gpu0", "meta", "cpu:x"):
        with pytest.raises(models.ModelError, match=f"unknown device '{spec}'"):
            models.resolve_device(spec)
    if not torch.cuda.is_available():
        with pytest.raises(models.ModelError, match="CUDA is not available"):
            models.resolve_device("cuda:0")
    with pytest.raises(models.ModelError, match="unknown device"):  # before converting a GGUF it cannot find
        models.load(str(tmp_path / "missing.gguf"), device="gpu0")
    assert models.resolve_device("cpu") == torch.device("cpu")
    assert models.resolve_dtype("auto", torch.device("cpu")) in (torch.float32, torch.bfloat16)


def test_corrupt_cache_is_reported(tmp_path, monkeypatch):
    monkeypatch.setenv("KNNSSD_CACHE", str(tmp_path))
    folder = tmp_path / "m"
    tiny("llama").save_pretrained(folder)
    (folder / conversion.CACHE_MARKER).write_text("{}")
    (folder / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(models.ModelError, match="delete the folder to rebuild it") as e:
        models.load(str(folder))
    assert "\n" not in str(e.value)


def test_fingerprint_ignores_dtype():
    model = tiny("qwen3")
    assert models.weights_fingerprint(model) == models.weights_fingerprint(tiny("qwen3", dtype=torch.bfloat16))
    assert models.weights_fingerprint(model) != models.weights_fingerprint(tiny("qwen3", seed=1))
