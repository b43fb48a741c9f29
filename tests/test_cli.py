"""The command line decodes with local model folders and refuses tokenizers that differ."""
import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from pad.cli import main
from tiny import tiny_pair


def _tokenizer(words):
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=words[0])


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    target, draft = tiny_pair("llama")
    words = [f"w{i}" for i in range(96)]
    for name, model, vocab in (("target", target, words), ("draft", draft, words),
                               ("other", draft, words[::-1])):
        model.save_pretrained(root / name)
        _tokenizer(vocab).save_pretrained(root / name)
    return root


def test_generate_prints_text_and_stats(folders, capsys):
    code = main(["generate", "--target", str(folders / "target"), "--draft", str(folders / "draft"),
                 "--prompt", "w1 w2 w3", "--max-new-tokens", "12", "-k", "3", "--dtype", "float32", "--json"])
    assert code == 0
    out = capsys.readouterr().out
    stats = json.loads(out[out.index("{"):])
    assert stats["new_tokens"] == 12 and stats["target_forwards"] >= 3
    assert 0.0 <= stats["acceptance_rate"] <= 1.0
    assert out.split()[0].startswith("w")


def test_mismatched_tokenizers_are_refused(folders, capsys):
    code = main(["generate", "--target", str(folders / "target"), "--draft", str(folders / "other"),
                 "--prompt", "w1", "--dtype", "float32"])
    assert code == 2
    assert "cannot be aligned" in capsys.readouterr().err
