"""Bad input to pad.generate and pad_kernels.verify_block gives a clear error, never a wrong answer."""
import pytest
import torch

import pad
from pad_kernels import FoldedClassifier, verify_block
from tiny import tiny_model, tiny_pair


@pytest.fixture(scope="module")
def pair():
    return tiny_pair("llama")


PROMPT = torch.tensor([[1, 2, 3]])


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(num_draft_tokens=0), "num_draft_tokens"),
        (dict(num_draft_tokens=-2), "num_draft_tokens"),
        (dict(num_draft_tokens=2.5), "num_draft_tokens"),
        (dict(sigma=-0.1), "sigma"),
        (dict(sigma=1.5), "sigma"),
        (dict(floor=2.0), "floor"),
        (dict(floor=-1e-9), "floor"),
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(policy="fast"), "unknown policy"),
        (dict(policy="pivot"), "needs a classifier"),
    ],
)
def test_bad_arguments(pair, kwargs, message):
    with pytest.raises(ValueError, match=message):
        pad.generate(*pair, PROMPT, **kwargs)


def test_pivot_without_classifier_at_sigma_zero_is_exact(pair):
    exact = pad.generate(*pair, PROMPT, policy="exact", max_new_tokens=10)
    pivot = pad.generate(*pair, PROMPT, policy="pivot", sigma=0.0, max_new_tokens=10)
    assert torch.equal(exact.sequences, pivot.sequences)


def test_bad_prompts(pair):
    with pytest.raises(ValueError, match="empty"):
        pad.generate(*pair, torch.empty(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="shape \\[B, P\\]"):
        pad.generate(*pair, torch.tensor([[[1, 2]]]))
    with pytest.raises(ValueError, match=r"lie in \[0, 96\)"):
        pad.generate(*pair, torch.tensor([[1, 96]]))
    with pytest.raises(ValueError, match="right padding"):
        pad.generate(*pair, torch.tensor([[1, 2, 0]]), attention_mask=torch.tensor([[1, 1, 0]]))
    with pytest.raises(ValueError, match="needs a draft"):
        pad.generate(pair[0], None, PROMPT)


def test_left_padding_is_ignored(pair):
    plain = pad.generate(*pair, PROMPT, max_new_tokens=8)
    padded = pad.generate(*pair, torch.tensor([[0, 0, 1, 2, 3]]), attention_mask=torch.tensor([[0, 0, 1, 1, 1]]),
                          max_new_tokens=8)
    assert padded.sequences[0, :2].tolist() == [0, 0]
    assert torch.equal(padded.sequences[:, 2:], plain.sequences)


def test_vocabularies_that_cannot_be_aligned():
    target = tiny_model("llama", 1000)
    with pytest.raises(ValueError, match="cannot be aligned"):
        pad.generate(target, tiny_model("llama", 96), PROMPT)
    draft = tiny_model("llama", 1000, seed=1)
    draft.config.eos_token_id, target.config.eos_token_id = 5, 6
    with pytest.raises(ValueError, match="eos_token_id"):
        pad.generate(target, draft, PROMPT)


def test_one_model_alone_scores_its_own_vocabulary():
    """Decoding or labeling with one model (the target with a draft-free drafter, or the draft alone): its size."""
    from pad.decoding.hf import shared_vocab_size

    target, draft = tiny_model("llama", 100), tiny_model("llama", 96, seed=1)
    assert shared_vocab_size(target, None) == 100 and shared_vocab_size(None, draft) == 96
    assert shared_vocab_size(target, draft) == 96


def test_padded_vocabularies_compare_on_the_shared_range():
    """A target padded to 100 ids and a draft of 96 decode like the target restricted to ids < 96."""
    target = tiny_model("qwen2", 100, seed=5)
    target_small, draft = tiny_pair("qwen2", 96, seed=5)
    with torch.no_grad():  # the target agrees with a 96-id model on the shared ids
        target.get_output_embeddings().weight[:96] = target_small.get_output_embeddings().weight
        target.get_input_embeddings().weight[:96] = target_small.get_input_embeddings().weight
        for a, b in zip(target.model.layers.parameters(), target_small.model.layers.parameters()):
            a.copy_(b)
    for seed in range(5):
        prompt = torch.randint(0, 96, (1, 4), generator=torch.Generator().manual_seed(seed))
        expected = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=False,
                                   max_new_tokens=20, suppress_tokens=list(range(96, 100)), pad_token_id=0)
        out = pad.generate(target, draft, prompt, num_draft_tokens=3, max_new_tokens=20)
        assert torch.equal(out.sequences, expected)
        # Either model may be the padded one.
        assert pad.generate(draft, target, prompt, max_new_tokens=20).sequences.max() < 96


def test_classifier_that_does_not_fit(pair, tmp_path):
    with pytest.raises(ValueError, match="hidden size 16"):
        pad.generate(*pair, PROMPT, classifier=pad.PivotClassifier(16, layer=-1))
    with pytest.raises(ValueError, match="layer -3"):
        pad.generate(*pair, PROMPT, classifier=pad.PivotClassifier(32, layer=-3))
    with pytest.raises(FileNotFoundError, match="not a pad classifier folder"):
        pad.generate(*pair, PROMPT, classifier=tmp_path / "nothing")
    d = pad.PivotClassifier(32, layer=-1).save(tmp_path / "clf")
    (d / "model.safetensors").write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError, match="corrupted classifier weights"):
        pad.generate(*pair, PROMPT, classifier=d)


@pytest.mark.parametrize("policy", ["target", "exact"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_target_logits(pair, policy, bad):
    target = tiny_model("llama", 96)
    with torch.no_grad():
        target.get_output_embeddings().weight[7, 3] = bad
    with pytest.raises(FloatingPointError, match="non-finite logits"):
        pad.generate(target, pair[1], PROMPT, policy=policy, max_new_tokens=5)


def test_verify_block_bad_inputs():
    logits = torch.randn(1, 3, 10)
    drafts = torch.tensor([[1, 2]])
    with pytest.raises(ValueError, match="unknown verification backend"):
        verify_block(logits, drafts, backend="tpu")
    with pytest.raises(RuntimeError, match="not available"):
        verify_block(logits, drafts, backend="cuda")
    with pytest.raises(ValueError, match="draft_tokens must be int64"):
        verify_block(logits, torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match=r"draft_tokens must lie in \[0, 10\)"):
        verify_block(logits, torch.tensor([[1, 10]]))
    with pytest.raises(ValueError, match="target_logits must be"):
        verify_block(logits[0], drafts)
    with pytest.raises(TypeError, match="fp32, bf16 or fp16"):
        verify_block(logits.double(), drafts)
    folded = FoldedClassifier(torch.zeros(6, 2), torch.zeros(2), torch.zeros(2), torch.tensor(0.0))
    with pytest.raises(ValueError, match="needs the target hidden states"):
        verify_block(logits, drafts, None, folded, sigma=0.5)
    with pytest.raises(ValueError, match="hidden must be"):
        verify_block(logits, drafts, torch.zeros(1, 3, 5), folded, sigma=0.5)
    with pytest.raises(ValueError, match="temperature > 0 needs draft_probs"):
        verify_block(logits, drafts, temperature=1.0)
    with pytest.raises(ValueError, match="uniforms must be"):
        verify_block(logits, drafts, temperature=1.0, draft_probs=torch.rand(1, 2, 10), uniforms=torch.rand(2))
    with pytest.raises(ValueError, match="sigma"):
        verify_block(logits, drafts, sigma=3.0)


@pytest.mark.parametrize("policy", ["target", "draft", "exact", "threshold@0.1", "typical", "fly"])
def test_zero_new_tokens_returns_the_prompt(pair, policy):
    batch = torch.tensor([[0, 4, 5], [1, 2, 3]])
    out = pad.generate(*pair, batch, attention_mask=torch.tensor([[0, 1, 1], [1, 1, 1]]), policy=policy,
                       max_new_tokens=0)
    assert torch.equal(out.sequences, batch) and out.lengths.tolist() == [0, 0]
    assert out.stats.new_tokens == 0 and out.stats.target_forwards == out.stats.draft_forwards == 0
